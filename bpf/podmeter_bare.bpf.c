// SPDX-License-Identifier: GPL-2.0
/* Benchmark baseline: the same header parsing as podmeter.bpf.c, with no map access. bench/datapath.py
 * and bench/flows.py run both programs on the same frame; the difference is the cost of filtering,
 * counting and (for flows) aggregating. */
#include "podmeter_parse.h"

SEC("tc")
int pm_parse_only(struct __sk_buff *skb)
{
	struct pm_packet pkt;

	if (pm_parse(skb, &pkt) == 0) {
		/* Keep everything parsed alive so the compiler cannot drop any of the parsing. */
		asm volatile("" : : "r"(pkt.src.word[3]), "r"(pkt.dst.word[3]), "r"(pkt.sport), "r"(pkt.dport),
			     "r"(pkt.protocol), "r"(pkt.tcp_flags) : "memory");
	}
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
