// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter's counting programs without flow aggregation (no `flows` or `flows_lost`
 * map), the same source built with PM_NO_FLOWS. bench/flows.py runs it next to podmeter.bpf.o on the same
 * frame; the difference is the cost of the flows map. The agent never loads this object. */
#define PM_NO_FLOWS
#include "podmeter.bpf.c"
