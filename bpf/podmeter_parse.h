/* SPDX-License-Identifier: GPL-2.0 */
/* The header parser of the TC programs: podmeter's counting program and the parse-only benchmark program.
 *
 * It finds the IPv4 or IPv6 source and destination of an Ethernet frame, skipping up to two in-band
 * VLAN tags (802.1Q / 802.1ad), and writes both as 16-byte addresses: IPv6 as is, IPv4 mapped as
 * ::ffff:a.b.c.d. Anything else (non-IP ethertypes, truncated headers, a version nibble that disagrees
 * with the ethertype, an IPv4 header length below 5 words) is "not parsed": the caller lets it pass.
 *
 * It also reads what a flow key needs from the transport header, in host byte order:
 * - protocol: the IPv4 protocol field, or the IPv6 next header (an IPv6 extension header is not walked:
 *   the flow then has protocol = that next header value, e.g. 0 hop-by-hop or 44 fragment, and ports 0);
 * - TCP (6) and UDP (17): source and destination port; TCP also its flags byte (FIN = bit 0 ... CWR = bit 7);
 * - ICMP (1) and ICMPv6 (58): the type in sport and the code in dport;
 * - an IPv4 fragment other than the first (fragment offset != 0), any other protocol, or a transport
 *   header cut short: ports 0 and flags 0.
 * The transport header is read in place when it is at a constant offset in the skb's linear part (IPv6,
 * IPv4 without options), else with bpf_skb_load_bytes: the verifier refuses a variable offset added to
 * a packet pointer to a loader without CAP_PERFMON (Spectre v1 rules), and the agent runs with CAP_BPF
 * and CAP_NET_ADMIN only. None of this decides whether a frame is parsed: the counters count exactly
 * the frames they counted before.
 *
 * In two steps: pm_parse_l3 (addresses, protocol: all a filter decision needs) and pm_parse_l4 (ports,
 * flags), so that the TC programs read the transport header only of a packet they keep; pm_parse does
 * both (the parse-only benchmark program).
 */
#ifndef PODMETER_PARSE_H
#define PODMETER_PARSE_H

#include "podmeter_common.h"
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>

#define PM_MAX_VLAN_TAGS 2

#define PM_TCP_FLAGS_OFFSET 13	 /* the flags byte of a TCP header: CWR ECE URG ACK PSH RST SYN FIN */

/* What the parser gives the programs. Ports (and ICMP type/code) in host byte order. */
struct pm_packet {
	struct pm_addr src;
	struct pm_addr dst;
	__u16 sport;	 /* TCP/UDP source port; ICMP/ICMPv6 type */
	__u16 dport;	 /* TCP/UDP destination port; ICMP/ICMPv6 code */
	__u8 protocol;	 /* IPv4 protocol / IPv6 next header */
	__u8 tcp_flags;	 /* TCP only: the header's flags byte */
	__u16 pad;
};

/* uapi has no VLAN header: this is the 4 bytes that follow the TPID. */
struct pm_vlan_hdr {
	__be16 tci;
	__be16 encapsulated_proto;
};

/* The first `need` bytes of the transport header: in the packet when `direct` and the skb's linear part
 * holds them, else copied into `copy`; NULL when the packet is shorter. `need` is a constant at every
 * call site (the functions are inlined) and `l4` a packet pointer at a constant offset from skb->data
 * (struct pm_l4_at): what lets the verifier check the direct reads. */
static __always_inline __u8 *pm_l4_bytes(struct __sk_buff *skb, __u8 *l4, void *data_end, __u32 offset,
					 __u8 *copy, __u32 need, int direct)
{
	if (direct && (void *)(l4 + need) <= data_end)
		return l4;
	if (bpf_skb_load_bytes(skb, offset, copy, need) < 0)
		return NULL;
	return copy;
}

/* Ports and flags from the transport header `offset` bytes into the frame (at packet pointer l4 when
 * `direct`). Leaves them as they are (0) when the protocol has none or the header is cut short. */
static __always_inline void pm_parse_ports(struct __sk_buff *skb, __u8 *l4, void *data_end, __u32 offset,
					   struct pm_packet *out, int direct)
{
	__u8 copy[sizeof(struct tcphdr)];
	__u8 *hdr;

	if (out->protocol == PM_PROTO_TCP) {
		hdr = pm_l4_bytes(skb, l4, data_end, offset, copy, sizeof(struct tcphdr), direct);
		if (hdr) {
			out->sport = bpf_ntohs(((struct tcphdr *)hdr)->source);
			out->dport = bpf_ntohs(((struct tcphdr *)hdr)->dest);
			out->tcp_flags = hdr[PM_TCP_FLAGS_OFFSET];
		}
	} else if (out->protocol == PM_PROTO_UDP) {
		hdr = pm_l4_bytes(skb, l4, data_end, offset, copy, sizeof(struct udphdr), direct);
		if (hdr) {
			out->sport = bpf_ntohs(((struct udphdr *)hdr)->source);
			out->dport = bpf_ntohs(((struct udphdr *)hdr)->dest);
		}
	} else if (out->protocol == PM_PROTO_ICMP || out->protocol == PM_PROTO_ICMPV6) {
		hdr = pm_l4_bytes(skb, l4, data_end, offset, copy, 2, direct); /* type, code */
		if (hdr) {
			out->sport = hdr[0];
			out->dport = hdr[1];
		}
	}
}

/* Where pm_parse_l3 left the transport header, for pm_parse_l4 to read it later (or never: the TC programs
 * read it only for a packet they keep, after the filter decision). `l4` is always a packet pointer at a
 * constant offset (the verifier checks every direct read against data_end); `direct` says whether the
 * header is really there (IPv6, IPv4 without options) or must be copied from `offset` (IPv4 options). */
struct pm_l4_at {
	__u8 *l4;
	__u32 offset;
	__u8 direct;
	__u8 present; /* 0: no transport header to read (an IPv4 fragment other than the first) */
};

/* The network layer: 0 with addresses and protocol in *out (ports and flags 0) and *at set, or -1 when
 * the frame is not a well-formed IPv4/IPv6 packet. */
static __always_inline int pm_parse_l3(struct __sk_buff *skb, struct pm_packet *out, struct pm_l4_at *at)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	void *cursor;
	__u32 offset = sizeof(*eth);
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
		offset += sizeof(*vlan);
	}

	out->sport = 0;
	out->dport = 0;
	out->tcp_flags = 0;
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = cursor;

		if ((void *)(ip + 1) > data_end)
			return -1;
		if (ip->version != 4 || ip->ihl < 5)
			return -1;
		pm_map_v4(&out->src, ip->saddr);
		pm_map_v4(&out->dst, ip->daddr);
		out->protocol = ip->protocol;
		/* Not the first fragment: no transport header. */
		at->present = !(ip->frag_off & bpf_htons(PM_IP_OFFSET_MASK));
		at->direct = ip->ihl == 5; /* no options: the transport header is at a constant offset */
		at->l4 = (__u8 *)(ip + 1);
		at->offset = offset + ip->ihl * 4;
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
		out->protocol = ip6->nexthdr;
		at->present = 1;
		at->direct = 1;
		at->l4 = (__u8 *)(ip6 + 1);
		at->offset = offset + sizeof(*ip6);
		return 0;
	}
	return -1;
}

/* The transport layer of a packet pm_parse_l3 parsed: ports and flags into *out. */
static __always_inline void pm_parse_l4(struct __sk_buff *skb, struct pm_packet *out, const struct pm_l4_at *at)
{
	if (at->present)
		pm_parse_ports(skb, at->l4, (void *)(long)skb->data_end, at->offset, out, at->direct);
}

/* Both layers at once. Returns 0 with *out filled, or -1 when the frame is not a well-formed IPv4/IPv6
 * packet. */
static __always_inline int pm_parse(struct __sk_buff *skb, struct pm_packet *out)
{
	struct pm_l4_at at;

	if (pm_parse_l3(skb, out, &at) != 0)
		return -1;
	pm_parse_l4(skb, out, &at);
	return 0;
}

#endif /* PODMETER_PARSE_H */
