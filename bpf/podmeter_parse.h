/* SPDX-License-Identifier: GPL-2.0 */
/* The header parser shared by podmeter's counting program and the parse-only benchmark program.
 *
 * It finds the IPv4 or IPv6 source and destination of an Ethernet frame, skipping up to two in-band
 * VLAN tags (802.1Q / 802.1ad), and writes both as 16-byte addresses: IPv6 as is, IPv4 mapped as
 * ::ffff:a.b.c.d. Anything else (non-IP ethertypes, truncated headers, a version nibble that disagrees
 * with the ethertype, an IPv4 header length below 5 words) is "not parsed": the caller lets it pass.
 */
#ifndef PODMETER_PARSE_H
#define PODMETER_PARSE_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define PM_MAX_VLAN_TAGS 2

/* An address as podmeter keys it: 16 bytes, IPv4 mapped into IPv6. Four words so that copies are cheap. */
struct pm_addr {
	__u32 word[4];
};

struct pm_addrs {
	struct pm_addr src;
	struct pm_addr dst;
};

/* uapi has no VLAN header: this is the 4 bytes that follow the TPID. */
struct pm_vlan_hdr {
	__be16 tci;
	__be16 encapsulated_proto;
};

static __always_inline void pm_map_v4(struct pm_addr *out, __be32 v4)
{
	out->word[0] = 0;
	out->word[1] = 0;
	out->word[2] = bpf_htonl(0x0000ffff);
	out->word[3] = v4;
}

/* Returns 0 with *out filled, or -1 when the frame is not a well-formed IPv4/IPv6 packet. */
static __always_inline int pm_parse(struct __sk_buff *skb, struct pm_addrs *out)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	void *cursor;
	__be16 proto;

	if ((void *)(eth + 1) > data_end)
		return -1;
	proto = eth->h_proto;
	cursor = eth + 1;

#pragma unroll
	for (int i = 0; i < PM_MAX_VLAN_TAGS; i++) {
		struct pm_vlan_hdr *vlan = cursor;

		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		if ((void *)(vlan + 1) > data_end)
			return -1;
		proto = vlan->encapsulated_proto;
		cursor = vlan + 1;
	}

	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = cursor;

		if ((void *)(ip + 1) > data_end)
			return -1;
		if (ip->version != 4 || ip->ihl < 5)
			return -1;
		pm_map_v4(&out->src, ip->saddr);
		pm_map_v4(&out->dst, ip->daddr);
		return 0;
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = cursor;

		if ((void *)(ip6 + 1) > data_end)
			return -1;
		if (ip6->version != 6)
			return -1;
		__builtin_memcpy(&out->src, &ip6->saddr, sizeof(out->src));
		__builtin_memcpy(&out->dst, &ip6->daddr, sizeof(out->dst));
		return 0;
	}
	return -1;
}

#endif /* PODMETER_PARSE_H */
