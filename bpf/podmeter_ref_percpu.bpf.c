// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter.bpf.o with per-CPU flows maps (plain adds, no atomics). The same
 * source as podmeter.bpf.o built with PM_FLOWS_PERCPU; bench/flows.py runs it next to podmeter.bpf.o
 * on the same frames (docs/flows.md, "What a packet costs"). The agent never loads this object. */
#define PM_FLOWS_PERCPU
#include "podmeter.bpf.c"
