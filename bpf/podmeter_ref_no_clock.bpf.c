// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter.bpf.o without the clock read (first_ns and last_ns 0): what the clock
 * costs. The same source as podmeter.bpf.o built with PM_NO_CLOCK; bench/flows.py runs it next to
 * podmeter.bpf.o on the same frames (docs/flows.md, "What a packet costs"). The agent never loads this
 * object. */
#define PM_NO_CLOCK
#include "podmeter.bpf.c"
