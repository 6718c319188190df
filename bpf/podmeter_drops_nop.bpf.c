// SPDX-License-Identifier: GPL-2.0
/* Benchmark floor: a program on the same tracepoint as pm_kfree_skb that does nothing. bench/drops.py runs
 * it under the same drop flood; its run time per call is what the kernel's run-time statistics cost
 * (two clock reads per call) plus the call itself. The agent never loads this object. */
#include "podmeter_common.h"

SEC("tp_btf/kfree_skb")
int pm_kfree_skb_nop(__u64 *ctx)
{
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
