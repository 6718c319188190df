// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: pm_from_pod with the flow entry as the only update of an observed packet (the
 * filter decides, the counter is added to only when the flow is lost): a bound, it does not keep the
 * per-pod counters of packets in flow entries. The same source as podmeter.bpf.o built with
 * PM_COUNT_FROM_FLOWS; bench/flows.py runs it next to podmeter.bpf.o on the same frames
 * (docs/flows.md, "What a packet costs"). The agent never loads this object. */
#define PM_COUNT_FROM_FLOWS
#include "podmeter.bpf.c"
