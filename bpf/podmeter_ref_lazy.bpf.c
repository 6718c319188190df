// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter.bpf.o with the counters created at an IP's first packet (a counters
 * miss then looks the filter up too). The same source as podmeter.bpf.o built with PM_COUNTERS_LAZY;
 * bench/flows.py runs it next to podmeter.bpf.o on the same frames (docs/flows.md, "What a packet
 * costs"). The agent never loads this object. */
#define PM_COUNTERS_LAZY
#include "podmeter.bpf.c"
