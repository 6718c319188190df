// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter.bpf.o reading the transport header before the filter decision. The
 * same source as podmeter.bpf.o built with PM_L4_EARLY; bench/flows.py runs it next to podmeter.bpf.o
 * on the same frames (docs/flows.md, "What a packet costs"). The agent never loads this object. */
#define PM_L4_EARLY
#include "podmeter.bpf.c"
