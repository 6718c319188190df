// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter.bpf.o with the filter an LPM trie (not an exact-match hash). The same
 * source as podmeter.bpf.o built with PM_FILTER_LPM; bench/flows.py runs it next to podmeter.bpf.o on
 * the same frames (docs/flows.md, "What a packet costs"). The agent never loads this object. */
#define PM_FILTER_LPM
#include "podmeter.bpf.c"
