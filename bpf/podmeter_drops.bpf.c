// SPDX-License-Identifier: GPL-2.0
/* podmeter's drop and TCP health programs: BTF tracepoints (tp_btf), not attached to any interface.
 *
 * pm_kfree_skb (tp_btf/kfree_skb) runs for every packet the kernel frees as dropped, on the whole node
 * (consumed packets go to the consume_skb tracepoint instead). A dropped IPv4/IPv6 packet whose source or
 * destination is in the agent's `filter` map is counted twice: per observed address, direction and
 * reason in `drops` (the per-pod metrics), and per dropped flow in `drop_flows` (the flow records with
 * verdict dropped). Every other packet costs the header read and the two filter lookups, nothing more.
 *
 * TCP health, per socket whose local address is observed (a pod's own socket), in `tcp`:
 *   pm_tcp_retransmit (tp_btf/tcp_retransmit_skb): a segment the socket retransmitted (err == 0 only, as
 *     the kernel's RetransSegs counts; the _noerr variant for kernels whose tracepoint has no err);
 *   pm_tcp_send_reset (tp_btf/tcp_send_reset): a RST the pod's stack sent (an answer to a segment, or an
 *     active reset of a socket);
 *   pm_tcp_receive_reset (tp_btf/tcp_receive_reset): a RST one of the pod's sockets accepted.
 * Retransmits are also counted per connection in `tcp_flows` (either end observed) so the agent can put
 * them on the flow records of the same interval.
 *
 * The agent drains (reads and deletes) every map each flow interval. Each map is bounded; an event that
 * finds its map full is counted in `drops_lost`, per map, never dropped silently.
 *
 * Kernel structures are read with CO-RE: only the fields used are declared (preserve_access_index) and
 * libbpf relocates their offsets against the running kernel's BTF at load. Layouts of the maps: docs/drops.md,
 * mirrored in podmeter/adapters/datapath/ebpf/drops.py. Change one, change both.
 */
#include <linux/in6.h>

#include "podmeter_maps.h"
#include "podmeter_flow.h"

#define PM_TCP_RETRANSMIT 0
#define PM_TCP_RESET_SENT 1
#define PM_TCP_RESET_RECEIVED 2

#define PM_LOST_DROPS 0
#define PM_LOST_DROP_FLOWS 1
#define PM_LOST_TCP 2
#define PM_LOST_TCP_FLOWS 3
#define PM_LOST_SLOTS 4

#define PM_OBSERVED_SRC 1
#define PM_OBSERVED_DST 2

#define PM_ETH_P_IP 0x0800
#define PM_ETH_P_IPV6 0x86DD
#define PM_AF_INET 2
#define PM_AF_INET6 10
#define PM_NO_HEADER 0xFFFF /* skb->network_header when unset (~0U in a __u16) */

/* --- the kernel's structures, as far as they are read (CO-RE) --------------------------------------- */

struct sk_buff {
	unsigned int len;
	__u16 protocol; /* __be16 */
	__u16 network_header;
	unsigned char *head;
} __attribute__((preserve_access_index));

struct sock_common {
	__u32 skc_daddr; /* __be32 */
	__u32 skc_rcv_saddr;
	__u16 skc_dport; /* __be16 */
	__u16 skc_num;	 /* host order */
	unsigned short skc_family;
	struct in6_addr skc_v6_daddr;
	struct in6_addr skc_v6_rcv_saddr;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
} __attribute__((preserve_access_index));

/* --- maps ---------------------------------------------------------------------------------------------- */

/* The agent's filter is declared in podmeter_maps.h, as for the TC programs: the loader makes this object use
 * the agent's pinned map (bpf_map__reuse_fd). */

/* 24 bytes, no implicit padding (the hash covers every byte). */
struct drop_key {
	__u8 addr[16];	 /* the observed end, IPv4 mapped as ::ffff:a.b.c.d */
	__u32 reason;	 /* enum skb_drop_reason, as the running kernel numbers it */
	__u8 direction; /* PM_DIR_INGRESS or PM_DIR_EGRESS */
	__u8 pad[3];
};

struct drop_value {
	__u64 packets;
	__u64 bytes; /* skb->len where the packet was dropped */
};

/* 44 bytes. */
struct drop_flow_key {
	__u8 src[16];
	__u8 dst[16];
	__u16 sport; /* host order; ICMP: the type */
	__u16 dport; /* host order; ICMP: the code */
	__u8 protocol;
	__u8 observed; /* PM_OBSERVED_SRC | PM_OBSERVED_DST */
	__u8 pad[2];
	__u32 reason;
};

/* 20 bytes. */
struct tcp_key {
	__u8 addr[16]; /* the socket's local address */
	__u32 event;	/* PM_TCP_RETRANSMIT, PM_TCP_RESET_SENT, PM_TCP_RESET_RECEIVED */
};

/* 36 bytes: one connection as the flow record leaving the socket's pod keys it. */
struct tcp_flow_key {
	__u8 src[16]; /* local address */
	__u8 dst[16]; /* remote address */
	__u16 sport;  /* local port, host order */
	__u16 dport;  /* remote port, host order */
};

/* max_entries here are defaults; the loader sets them (--drop-map-size) before loading. Preallocated:
 * updates from tracing context never allocate. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct drop_key);
	__type(value, struct drop_value);
} drops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct drop_flow_key);
	/* podmeter_flow.h: the flows maps' values, added to the same way (first_ns/last_ns: bpf_ktime_get_ns()) */
	__type(value, struct flow_value);
} drop_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct tcp_key);
	__type(value, __u64);
} tcp SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct tcp_flow_key);
	__type(value, __u64);
} tcp_flows SEC(".maps");

/* Events that found their map full, per map (PM_LOST_*), per CPU. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PM_LOST_SLOTS);
	__type(key, __u32);
	__type(value, __u64);
} drops_lost SEC(".maps");

/* --- helpers ----------------------------------------------------------------------------------------- */

static __always_inline void pm_lost(__u32 slot)
{
	__u64 *lost = bpf_map_lookup_elem(&drops_lost, &slot);

	if (lost)
		__sync_fetch_and_add(lost, 1); /* per-CPU, but the TCP programs may interrupt one another */
}

/* Add `value` to the u64 at `key` in a hash `map` of counts, creating it if needed; a full map counts in
 * `slot`. */
static __always_inline void pm_count_or_lose(void *map, const void *key, __u64 value, __u32 slot)
{
	if (!pm_count_u64(map, key, value))
		pm_lost(slot);
}

/* --- drops --------------------------------------------------------------------------------------------- */

struct pm_l3 {
	struct pm_addr src;
	struct pm_addr dst;
	__u32 l4_offset; /* from skb->head */
	__u8 protocol;
	__u8 fragment; /* an IPv4 fragment other than the first: no transport header */
};

/* The addresses of the skb's IP header. 0 if parsed, else the packet is not IP (or has no header). */
static __always_inline int pm_l3(const struct sk_buff *skb, struct pm_l3 *l3)
{
	unsigned char *head = skb->head;
	__u16 nh = skb->network_header;
	__u16 proto = skb->protocol;

	if (nh == PM_NO_HEADER)
		return -1;
	if (proto == bpf_htons(PM_ETH_P_IP)) {
		struct {
			__u8 vihl;
			__u8 tos;
			__u16 tot_len;
			__u16 id;
			__u16 frag_off;
			__u8 ttl;
			__u8 protocol;
			__u16 check;
			__u32 saddr;
			__u32 daddr;
		} ip;

		if (bpf_probe_read_kernel(&ip, sizeof(ip), head + nh) != 0 || (ip.vihl >> 4) != 4)
			return -1;
		pm_map_v4(&l3->src, ip.saddr);
		pm_map_v4(&l3->dst, ip.daddr);
		l3->protocol = ip.protocol;
		l3->l4_offset = nh + (ip.vihl & 0x0F) * 4;
		l3->fragment = (bpf_ntohs(ip.frag_off) & PM_IP_OFFSET_MASK) != 0;
		return 0;
	}
	if (proto == bpf_htons(PM_ETH_P_IPV6)) {
		struct {
			__u32 vtcfl;
			__u16 payload_len;
			__u8 nexthdr;
			__u8 hop_limit;
			struct pm_addr saddr;
			struct pm_addr daddr;
		} ip6;

		if (bpf_probe_read_kernel(&ip6, sizeof(ip6), head + nh) != 0 || (ip6.vtcfl & 0xF0) != 0x60)
			return -1;
		l3->src = ip6.saddr;
		l3->dst = ip6.daddr;
		l3->protocol = ip6.nexthdr;
		l3->l4_offset = nh + 40;
		l3->fragment = 0;
		return 0;
	}
	return -1;
}

/* Ports (ICMP: type and code) and TCP flags of the transport header, in host order; zeros if absent. */
static __always_inline void pm_l4(const struct sk_buff *skb, const struct pm_l3 *l3, __u16 *sport, __u16 *dport,
				  __u8 *tcp_flags)
{
	__u8 l4[14];

	*sport = 0;
	*dport = 0;
	*tcp_flags = 0;
	if (l3->fragment)
		return;
	switch (l3->protocol) {
	case PM_PROTO_TCP:
		if (bpf_probe_read_kernel(l4, 14, skb->head + l3->l4_offset) != 0)
			return;
		*tcp_flags = l4[13];
		break;
	case PM_PROTO_UDP:
		if (bpf_probe_read_kernel(l4, 4, skb->head + l3->l4_offset) != 0)
			return;
		break;
	case PM_PROTO_ICMP:
	case PM_PROTO_ICMPV6:
		if (bpf_probe_read_kernel(l4, 2, skb->head + l3->l4_offset) != 0)
			return;
		*sport = l4[0];
		*dport = l4[1];
		return;
	default:
		return;
	}
	*sport = ((__u16)l4[0] << 8) | l4[1];
	*dport = ((__u16)l4[2] << 8) | l4[3];
}

static __always_inline void pm_drop_count(const struct pm_addr *addr, __u8 direction, __u32 reason, __u64 len)
{
	struct drop_key key = { .reason = reason, .direction = direction };
	struct drop_value first = { .packets = 1, .bytes = len };
	struct drop_value *value;
	int lost;

	__builtin_memcpy(key.addr, addr, sizeof(key.addr));
	value = pm_upsert(&drops, &key, &first, &lost);
	if (value) {
		__sync_fetch_and_add(&value->packets, 1);
		__sync_fetch_and_add(&value->bytes, len);
	} else if (lost) {
		pm_lost(PM_LOST_DROPS);
	}
}

static __always_inline void pm_drop_flow(const struct sk_buff *skb, const struct pm_l3 *l3, __u8 observed,
					 __u32 reason, __u64 len)
{
	struct drop_flow_key key;
	__u64 now = bpf_ktime_get_ns(); /* the coarse clock is not offered to tracing programs */
	__u8 tcp_flags;

	__builtin_memcpy(key.src, &l3->src, sizeof(key.src));
	__builtin_memcpy(key.dst, &l3->dst, sizeof(key.dst));
	pm_l4(skb, l3, &key.sport, &key.dport, &tcp_flags);
	key.protocol = l3->protocol;
	key.observed = observed;
	key.pad[0] = 0;
	key.pad[1] = 0;
	key.reason = reason;

	if (pm_flow_found(&drop_flows, &key, len, now, tcp_flags))
		return;
	if (pm_flow_create(&drop_flows, &key, len, now, tcp_flags) == PM_FLOW_LOST)
		pm_lost(PM_LOST_DROP_FLOWS);
}

/* void trace_kfree_skb(struct sk_buff *skb, void *location, enum skb_drop_reason reason, ...) */
SEC("tp_btf/kfree_skb")
int pm_kfree_skb(__u64 *ctx)
{
	struct sk_buff *skb = (struct sk_buff *)ctx[0];
	struct pm_l3 l3;
	__u32 reason;
	__u8 observed;
	__u64 len;

	if (pm_l3(skb, &l3) != 0)
		return 0;
	observed = pm_observed(&l3.src) ? PM_OBSERVED_SRC : 0;
	if (pm_observed(&l3.dst))
		observed |= PM_OBSERVED_DST;
	if (!observed)
		return 0; /* the path of almost every call: a packet of no observed pod */

	reason = (__u32)ctx[2];
	len = skb->len;
	if (observed & PM_OBSERVED_SRC)
		pm_drop_count(&l3.src, PM_DIR_EGRESS, reason, len);
	if (observed & PM_OBSERVED_DST)
		pm_drop_count(&l3.dst, PM_DIR_INGRESS, reason, len);
	pm_drop_flow(skb, &l3, observed, reason, len);
	return 0;
}

/* --- TCP health ---------------------------------------------------------------------------------------- */

struct pm_conn {
	struct pm_addr local;
	struct pm_addr remote;
	__u16 lport; /* host order */
	__u16 rport;
};

/* The socket's addresses and ports; -1 for a socket that is neither AF_INET nor AF_INET6. An AF_INET6
 * socket talking IPv4 has mapped addresses (::ffff:a.b.c.d): the same encoding as the filter's keys. */
static __always_inline int pm_sock_conn(const struct sock *sk, struct pm_conn *conn)
{
	unsigned short family = sk->__sk_common.skc_family;

	if (family == PM_AF_INET) {
		pm_map_v4(&conn->local, sk->__sk_common.skc_rcv_saddr);
		pm_map_v4(&conn->remote, sk->__sk_common.skc_daddr);
	} else if (family == PM_AF_INET6) {
		if (bpf_probe_read_kernel(&conn->local, 16, &sk->__sk_common.skc_v6_rcv_saddr) != 0 ||
		    bpf_probe_read_kernel(&conn->remote, 16, &sk->__sk_common.skc_v6_daddr) != 0)
			return -1;
	} else {
		return -1;
	}
	conn->lport = sk->__sk_common.skc_num;
	conn->rport = bpf_ntohs(sk->__sk_common.skc_dport);
	return 0;
}

static __always_inline void pm_tcp_event(const struct pm_addr *local, __u32 event)
{
	struct tcp_key key = { .event = event };

	__builtin_memcpy(key.addr, local, sizeof(key.addr));
	pm_count_or_lose(&tcp, &key, 1, PM_LOST_TCP);
}

static __always_inline int pm_retransmit(const struct sock *sk)
{
	struct pm_conn conn;
	struct tcp_flow_key key;
	int local;

	if (!sk || pm_sock_conn(sk, &conn) != 0)
		return 0;
	local = pm_observed(&conn.local);
	if (local)
		pm_tcp_event(&conn.local, PM_TCP_RETRANSMIT);
	if (!local && !pm_observed(&conn.remote))
		return 0;
	__builtin_memcpy(key.src, &conn.local, sizeof(key.src));
	__builtin_memcpy(key.dst, &conn.remote, sizeof(key.dst));
	key.sport = conn.lport;
	key.dport = conn.rport;
	pm_count_or_lose(&tcp_flows, &key, 1, PM_LOST_TCP_FLOWS);
	return 0;
}

/* void trace_tcp_retransmit_skb(const struct sock *sk, const struct sk_buff *skb, int err) */
SEC("tp_btf/tcp_retransmit_skb")
int pm_tcp_retransmit(__u64 *ctx)
{
	if ((int)ctx[2] != 0)
		return 0; /* the retransmission failed (e.g. the previous copy is still queued): not sent */
	return pm_retransmit((const struct sock *)ctx[0]);
}

/* The same for kernels whose tracepoint has no err argument (it then fires for sent segments only). */
SEC("tp_btf/tcp_retransmit_skb")
int pm_tcp_retransmit_noerr(__u64 *ctx)
{
	return pm_retransmit((const struct sock *)ctx[0]);
}

/* void trace_tcp_send_reset(const struct sock *sk, const struct sk_buff *skb, ...): skb is the segment
 * answered (then the pod's end is its destination), NULL for an active reset of sk. */
SEC("tp_btf/tcp_send_reset")
int pm_tcp_send_reset(__u64 *ctx)
{
	const struct sock *sk = (const struct sock *)ctx[0];
	const struct sk_buff *skb = (const struct sk_buff *)ctx[1];
	struct pm_conn conn;
	struct pm_l3 l3;

	if (skb) {
		if (pm_l3(skb, &l3) != 0)
			return 0;
		conn.local = l3.dst;
	} else if (!sk || pm_sock_conn(sk, &conn) != 0) {
		return 0;
	}
	if (pm_observed(&conn.local))
		pm_tcp_event(&conn.local, PM_TCP_RESET_SENT);
	return 0;
}

/* void trace_tcp_receive_reset(struct sock *sk): sk accepted a RST. */
SEC("tp_btf/tcp_receive_reset")
int pm_tcp_receive_reset(__u64 *ctx)
{
	const struct sock *sk = (const struct sock *)ctx[0];
	struct pm_conn conn;

	if (!sk || pm_sock_conn(sk, &conn) != 0)
		return 0;
	if (pm_observed(&conn.local))
		pm_tcp_event(&conn.local, PM_TCP_RESET_RECEIVED);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
