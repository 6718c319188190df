// SPDX-License-Identifier: GPL-2.0
/* podmeter's packet counter and flow aggregator, attached to the host side of each pod veth.
 *
 * On the host-side end of a pod's veth, tc ingress sees packets leaving the pod and tc egress sees
 * packets entering it. So pm_from_pod (tc ingress) counts direction EGRESS keyed on the source address,
 * and pm_to_pod (tc egress) counts direction INGRESS keyed on the destination address. Only addresses
 * present in the `filter` map are counted. Both programs return TC_ACT_UNSPEC: they never change a
 * verdict, so tc filters of other tools after them keep running (under TCX, TC_ACT_OK would stop them).
 *
 * Flows: every parsed packet with at least one observed end (source or destination in `filter`) is also
 * added to its entry (addresses, ports, protocol, observation point) in the active flows map, `flows_a`
 * or `flows_b`, whichever the one-slot map-in-map `flows` points to. To drain, userspace flips the slot
 * and, once the kernel has waited for running programs, reads and clears the other map. A packet that
 * finds the active map full is counted in `flows_lost`.
 * Built with -DPM_NO_FLOWS (podmeter_noflows.bpf.c, the benchmark's reference) the programs only count.
 *
 * Map layouts are documented in docs/datapath.md; userspace encodes the same structs in
 * podmeter/adapters/datapath/ebpf/layout.py. Change one, change both (and the docs).
 */
#include "podmeter_parse.h"

#define PM_DIR_INGRESS 0 /* into the pod */
#define PM_DIR_EGRESS 1	 /* out of the pod */

/* Addresses in keys are byte arrays (not struct pm_addr's words) so that `bpftool map dump` prints them
 * as readable bytes, e.g. IPv4 10.244.1.7 as [0,0,0,0,0,0,0,0,0,0,255,255,10,244,1,7]. */
struct filter_key {
	__u32 prefixlen; /* always 128: one host address per entry */
	__u8 addr[16];
};

struct counter_key {
	__u8 addr[16];
	__u32 direction; /* PM_DIR_INGRESS or PM_DIR_EGRESS */
};

struct counter_value {
	__u64 packets;
	__u64 bytes; /* skb->len at the hook: the whole frame including its Ethernet header */
};

/* max_entries here are defaults; the loader sets them from --filter-map-size before loading. */
struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 255);
	__type(key, struct filter_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} filter SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 510);
	__type(key, struct counter_key);
	__type(value, struct counter_value);
} counters SEC(".maps");

#ifndef PM_NO_FLOWS
#define PM_OBS_FROM_POD 0 /* pm_from_pod: tc ingress of the host-side veth */
#define PM_OBS_TO_POD 1	  /* pm_to_pod: tc egress of the host-side veth */
#define PM_EEXIST 17

/* One flow as seen at one observation point. 40 bytes, no implicit padding (the hash covers every byte,
 * so `pad` is always written as 0). */
struct flow_key {
	__u8 src[16]; /* same encoding as filter_key.addr */
	__u8 dst[16];
	__u16 sport; /* host byte order; ICMP/ICMPv6: the type */
	__u16 dport; /* host byte order; ICMP/ICMPv6: the code */
	__u8 protocol; /* IPv4 protocol / IPv6 next header */
	__u8 observation; /* PM_OBS_FROM_POD or PM_OBS_TO_POD */
	__u8 pad[2];
};

/* Shared by all CPUs (not per-CPU: per-CPU copies times CPUs times max_entries is too much kernel memory
 * on big nodes), so updates are atomic adds. 40 bytes. */
struct flow_value {
	__u64 packets;
	__u64 bytes;	/* skb->len at the hook, like counter_value.bytes */
	__u64 first_ns; /* bpf_ktime_get_coarse_ns() (CLOCK_MONOTONIC, coarse) of the first packet */
	__u64 last_ns;	/* ... of the latest packet (within a clock tick under concurrent updates) */
	__u64 tcp_flags; /* OR of the TCP flags bytes (low 8 bits). 64 bits because a 32-bit atomic OR
			  * needs -mcpu=v3, a 64-bit one does not. */
};

struct flows_lost_value {
	__u64 packets; /* packets that found `flows` full */
	__u64 bytes;
};

/* The flows are double-buffered: two identical hash maps, `flows_a` and `flows_b`, and `flows`, an
 * ARRAY_OF_MAPS of one slot holding the active one. The programs look the active map up once per packet
 * (an array lookup the verifier inlines: no helper call) and add to it. To drain, userspace points the
 * slot at the other map; that syscall returns only after an RCU grace period (the kernel's
 * maybe_wait_bpf_programs() after every map-in-map update), and each program run is one RCU read-side
 * critical section that looks the slot up once, so when it returns no program can still hold the old
 * map. Userspace then reads and clears the old map at leisure: no packet can land in it any more, and
 * none lands between two drains (the loss of deleting an entry while another CPU adds to it, which a
 * single map has, cannot happen). A tiny index map choosing between two statically referenced maps would
 * need a grace period of userspace's own (an ARRAY update waits for nothing) and makes one helper call
 * site see two maps (the verifier then stops inlining it). See docs/datapath.md.
 *
 * Each map is preallocated (about 144 bytes per max_entries, whatever the CPU count): inserts take a free
 * element, and the drain's batched lookup-and-delete returns elements to the free list, three times
 * faster than freeing them (BPF_F_NO_PREALLOC) for 100,000 entries. */
struct flows_map {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024); /* set by the loader (flow_size) */
	__type(key, struct flow_key);
	__type(value, struct flow_value);
};

struct flows_map flows_a SEC(".maps"), flows_b SEC(".maps");

/* Slot 0: the map the programs add to. libbpf sets it to flows_a when it creates the map; a pinned one
 * keeps its slot, which userspace checks after the load (empty: packets would go to flows_lost). For a
 * hash map the kernel checks an inner map's type, key and value sizes and flags, not max_entries. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct flows_map);
} flows SEC(".maps") = {
	.values = { [0] = &flows_a },
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flows_lost_value);
} flows_lost SEC(".maps");
#endif /* PM_NO_FLOWS */

static __always_inline void pm_add(struct counter_value *value, struct __sk_buff *skb)
{
	/* Per-CPU value and tc runs with preemption off: plain adds are race-free. */
	value->packets += 1;
	value->bytes += skb->len;
}

/* Count one packet for addr if addr is in the filter; returns 1 if it is (observed), else 0.
 *
 * Invariant (kept together with userspace): a counters entry exists only while its IP is in the filter.
 * Userspace removes an IP in two steps, delete from filter then take (read and delete) its counters,
 * and this program never creates an entry for an IP that has left the filter. So the hot path of an
 * observed IP is a single hash lookup; the LPM trie is consulted only when no entry exists yet. Packets
 * counted between the two userspace steps belong to the leaving pod and are part of what it takes. */
static __always_inline int pm_count(struct __sk_buff *skb, const struct pm_addr *addr, __u32 direction)
{
	struct counter_key ckey = { .direction = direction };
	struct filter_key fkey = { .prefixlen = 128 };
	struct counter_value first = { .packets = 1, .bytes = skb->len };
	struct counter_value *value;

	__builtin_memcpy(ckey.addr, addr, sizeof(ckey.addr));
	__builtin_memcpy(fkey.addr, addr, sizeof(fkey.addr));

	value = bpf_map_lookup_elem(&counters, &ckey);
	if (value) {
		pm_add(value, skb);
		return 1;
	}
	if (!bpf_map_lookup_elem(&filter, &fkey))
		return 0;
	if (bpf_map_update_elem(&counters, &ckey, &first, BPF_NOEXIST) == 0) {
		/* If userspace deleted the IP and took its counters between our filter lookup and this
		 * insert, the new entry would outlive the pod (and break the invariant). Re-check the
		 * filter and drop the entry if the IP has gone: one packet of a deleted pod is lost. */
		if (!bpf_map_lookup_elem(&filter, &fkey)) {
			bpf_map_delete_elem(&counters, &ckey);
			return 0;
		}
		return 1;
	}
	/* EEXIST: another CPU created the entry meanwhile and our CPU's slot exists now. E2BIG (map full)
	 * leaves the packet uncounted (the IP is still observed). */
	value = bpf_map_lookup_elem(&counters, &ckey);
	if (value)
		pm_add(value, skb);
	return 1;
}

#ifndef PM_NO_FLOWS
static __always_inline int pm_observed(const struct pm_addr *addr)
{
	struct filter_key fkey = { .prefixlen = 128 };

	__builtin_memcpy(fkey.addr, addr, sizeof(fkey.addr));
	return bpf_map_lookup_elem(&filter, &fkey) != 0;
}

static __always_inline void pm_flow_add(struct flow_value *value, __u64 len, __u64 now, __u8 tcp_flags)
{
	__sync_fetch_and_add(&value->packets, 1);
	__sync_fetch_and_add(&value->bytes, len);
	/* The coarse clock moves once a tick: most packets skip the store, and the cache line stays shared
	 * longer. Two CPUs racing here may leave the earlier of two times one tick apart. */
	if (now > value->last_ns)
		value->last_ns = now;
	if ((value->tcp_flags & tcp_flags) != tcp_flags)
		__sync_fetch_and_or(&value->tcp_flags, (__u64)tcp_flags);
}

/* Add one packet to its flow entry in the active flows map; a packet that finds it full (or no active
 * map) is counted in flows_lost. */
static __always_inline void pm_flow(struct __sk_buff *skb, const struct pm_packet *pkt, __u8 observation)
{
	struct flow_key key;
	struct flow_value *value;
	struct flows_lost_value *lost;
	void *active;
	__u64 now = bpf_ktime_get_coarse_ns();
	__u32 zero = 0;
	long err;

	__builtin_memcpy(key.src, &pkt->src, sizeof(key.src));
	__builtin_memcpy(key.dst, &pkt->dst, sizeof(key.dst));
	key.sport = pkt->sport;
	key.dport = pkt->dport;
	key.protocol = pkt->protocol;
	key.observation = observation;
	key.pad[0] = 0;
	key.pad[1] = 0;

	/* Looked up once: everything below goes to the same map, even if userspace flips the slot meanwhile
	 * (it then waits for this run to end before reading that map). */
	active = bpf_map_lookup_elem(&flows, &zero);
	if (!active)
		goto lost;
	value = bpf_map_lookup_elem(active, &key);
	if (value) {
		pm_flow_add(value, skb->len, now, pkt->tcp_flags);
		return;
	}
	{
		struct flow_value first = {
			.packets = 1,
			.bytes = skb->len,
			.first_ns = now,
			.last_ns = now,
			.tcp_flags = pkt->tcp_flags,
		};

		err = bpf_map_update_elem(active, &key, &first, BPF_NOEXIST);
	}
	if (err == 0)
		return;
	if (err == -PM_EEXIST) { /* another CPU created it meanwhile */
		value = bpf_map_lookup_elem(active, &key);
		if (value) {
			pm_flow_add(value, skb->len, now, pkt->tcp_flags);
			return;
		}
	}
	/* E2BIG: the map is full until the next drain. Never silent: */
lost:
	lost = bpf_map_lookup_elem(&flows_lost, &zero);
	if (lost) {
		lost->packets += 1; /* per-CPU slot, preemption off: plain adds are race-free */
		lost->bytes += skb->len;
	}
}
#endif /* PM_NO_FLOWS */

/* The pod is the source: count it (direction EGRESS). The flow is kept when the source is observed
 * (known from the counter path at no extra cost) or else when the destination is. */
SEC("tc")
int pm_from_pod(struct __sk_buff *skb)
{
	struct pm_packet pkt;
	int observed;

	if (pm_parse(skb, &pkt) != 0)
		return TC_ACT_UNSPEC;
	observed = pm_count(skb, &pkt.src, PM_DIR_EGRESS);
#ifndef PM_NO_FLOWS
	if (observed || pm_observed(&pkt.dst))
		pm_flow(skb, &pkt, PM_OBS_FROM_POD);
#else
	(void)observed;
#endif
	return TC_ACT_UNSPEC;
}

/* The pod is the destination: count it (direction INGRESS); the flow the same way, ends swapped. */
SEC("tc")
int pm_to_pod(struct __sk_buff *skb)
{
	struct pm_packet pkt;
	int observed;

	if (pm_parse(skb, &pkt) != 0)
		return TC_ACT_UNSPEC;
	observed = pm_count(skb, &pkt.dst, PM_DIR_INGRESS);
#ifndef PM_NO_FLOWS
	if (observed || pm_observed(&pkt.src))
		pm_flow(skb, &pkt, PM_OBS_TO_POD);
#else
	(void)observed;
#endif
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
