// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: the counting and flow program as it was before issue 29: the filter an LPM
 * trie, the transport header read before the filter decision, counters created by the program at an
 * IP's first packet. The same source as podmeter.bpf.o built with PM_FILTER_LPM, PM_L4_EARLY,
 * PM_COUNTERS_LAZY; bench/flows.py runs it next to podmeter.bpf.o on the same frames (docs/flows.md,
 * "What a packet costs"). The agent never loads this object. */
#define PM_FILTER_LPM
#define PM_L4_EARLY
#define PM_COUNTERS_LAZY
#include "podmeter.bpf.c"
