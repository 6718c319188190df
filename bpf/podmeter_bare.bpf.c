// SPDX-License-Identifier: GPL-2.0
/* Benchmark baseline: the same header parsing as podmeter.bpf.c, with no map access. bench/datapath.py
 * runs both programs on the same frame; the difference is the cost of filtering and counting. */
#include "podmeter_parse.h"

SEC("tc")
int pm_parse_only(struct __sk_buff *skb)
{
	struct pm_addrs addrs;

	if (pm_parse(skb, &addrs) == 0) {
		/* Keep the parsed addresses alive so the compiler cannot drop the parsing. */
		asm volatile("" : : "r"(addrs.src.word[3]), "r"(addrs.dst.word[3]) : "memory");
	}
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
