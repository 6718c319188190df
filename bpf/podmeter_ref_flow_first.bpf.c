// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: pm_from_pod looking the flow entry up first and stopping there when it exists
 * (no filter, no counter): the floor of a packet with flows, not a program that keeps the counters.
 * The same source as podmeter.bpf.o built with PM_FLOW_FIRST; bench/flows.py runs it next to
 * podmeter.bpf.o on the same frames (docs/flows.md, "What a packet costs"). The agent never loads this
 * object. */
#define PM_FLOW_FIRST
#include "podmeter.bpf.c"
