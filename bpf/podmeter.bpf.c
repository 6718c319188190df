// SPDX-License-Identifier: GPL-2.0
/* podmeter's packet counter and flow aggregator, attached to the host side of each pod veth.
 *
 * On the host-side end of a pod's veth, tc ingress sees packets leaving the pod and tc egress sees
 * packets entering it. So pm_from_pod (tc ingress) counts direction EGRESS keyed on the source address,
 * and pm_to_pod (tc egress) counts direction INGRESS keyed on the destination address. Only addresses
 * present in the `filter` map are counted (their `counters` entries exist exactly while they are: see
 * pm_count). Both programs return TC_ACT_UNSPEC: they never change a
 * verdict, so tc filters of other tools after them keep running (under TCX, TC_ACT_OK would stop them).
 *
 * Flows: every parsed packet with at least one observed end (source or destination in `filter`) is also
 * added to its entry (addresses, ports, protocol, observation point) in the active flows map, `flows_a`
 * or `flows_b`, whichever the one-slot map-in-map `flows` points to. To drain, userspace flips the slot
 * and, once the kernel has waited for running programs, reads and clears the other map. A packet that
 * finds the active map full, or whose pod link has had its share of a nearly full map (the fairness rule,
 * pm_flow_admit), is counted in `flows_lost`, once per packet (pm_flow_lost).
 * Built with -DPM_NO_FLOWS (podmeter_noflows.bpf.c, the benchmark's reference) the programs only count.
 *
 * Per packet: the network header (pm_parse_l3), the counter of the pod's end (one hash lookup, which is
 * also the filter decision for that end), the filter for the other end if needed, and only for a kept
 * packet (an observed end) the transport header and its flow (pm_keep: the place for anything else done
 * to kept packets). The benchmark references podmeter_ref_*.bpf.c build other designs from this source
 * with a define (PM_FILTER_LPM, PM_L4_EARLY, PM_COUNTERS_LAZY, PM_FLOWS_PERCPU, PM_COUNT_FROM_FLOWS,
 * PM_FLOW_FIRST, PM_NO_CLOCK); docs/flows.md has their figures and why they are not the program.
 *
 * Map layouts are documented in docs/datapath.md; userspace encodes the same structs in
 * podmeter/adapters/datapath/ebpf/layout.py, and refuses an object whose BTF lays them out otherwise.
 * Change one, change both (and the docs).
 */
#include "podmeter_parse.h"
#include "podmeter_maps.h"
#ifndef PM_NO_FLOWS
#include "podmeter_flow.h"
#endif
#include "podmeter_dns.h"

struct counter_key {
	__u8 addr[16];
	__u32 direction; /* PM_DIR_INGRESS or PM_DIR_EGRESS */
};

struct counter_value {
	__u64 packets;
	__u64 bytes; /* skb->len at the hook: the whole frame including its Ethernet header */
};

/* max_entries is a default; the loader sets it from --filter-map-size (twice it) before loading. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(max_entries, 510);
	__type(key, struct counter_key);
	__type(value, struct counter_value);
} counters SEC(".maps");

#ifndef PM_NO_FLOWS
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
#ifdef PM_FLOWS_PERCPU
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH); /* benchmark reference: one value per CPU, plain adds */
#else
	__uint(type, BPF_MAP_TYPE_HASH);
#endif
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

/* The flow of the last packet this CPU's pm_from_pod could not add (its observation: from-pod), so that
 * pm_to_pod does not count the same packet lost a second time (see pm_flow_lost). Program state only:
 * userspace never reads it. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flow_key);
} flows_lost_seen SEC(".maps");

/* Fairness: a full flows map must not be one pod's. Past `threshold` entries in the active map, each pod
 * link may create at most `share` more until the next drain (pm_flow_admit). Written by userspace: the
 * configuration at load, `entries` reset to 0 (and flows_share emptied) by each drain that flips. */
struct flows_fill {
	__u64 entries;	 /* entries the programs created in the active map since the last flip */
	__u32 threshold; /* 0: no rule (every packet may create its entry while the map has room) */
	__u32 share;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct flows_fill);
} flows_fill SEC(".maps");

/* Entries each pod link created past the threshold since the last flip. Keyed by the hook's interface
 * (skb->ifindex: the host side of the pod's veth), not an address: a pod cannot take more shares by
 * sending from addresses that are not its own, and a dual-stack pod has one share. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096); /* set by the loader */
	__type(key, __u32);
	__type(value, __u64);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} flows_share SEC(".maps");
#endif /* PM_NO_FLOWS */

static __always_inline void pm_add(struct counter_value *value, struct __sk_buff *skb)
{
	/* Per-CPU value and tc runs with preemption off: plain adds are race-free. */
	value->packets += 1;
	value->bytes += skb->len;
}

#ifdef PM_COUNTERS_LAZY
/* The first packet of an IP that has no counters entry yet (the benchmark reference only). */
static __always_inline int pm_count_first(struct __sk_buff *skb, const struct pm_addr *addr,
					  const struct counter_key *ckey)
{
	struct filter_key fkey = { .prefixlen = 128 };
	struct counter_value first = { .packets = 1, .bytes = skb->len };
	struct counter_value *value;
	int lost;

	__builtin_memcpy(fkey.addr, addr, sizeof(fkey.addr));
	if (!bpf_map_lookup_elem(&filter, &fkey))
		return 0;
	value = pm_create(&counters, ckey, &first, &lost);
	if (!value) {
		/* Userspace may have deleted the IP and taken its counters since the filter lookup. */
		if (!lost && !bpf_map_lookup_elem(&filter, &fkey)) {
			bpf_map_delete_elem(&counters, ckey);
			return 0;
		}
		return 1;
	}
	pm_add(value, skb);
	return 1;
}
#endif

/* Count one packet for addr if addr is observed; returns 1 if it is, else 0.
 *
 * Invariant (kept by userspace): a counters entry exists for both directions of an IP exactly while the
 * IP is in the filter. Userspace creates them (zero) before it adds the IP to the filter, and removes an
 * IP in two steps, delete from the filter then take (read and delete) its counters. So the counters map
 * is the filter of the counting path: one hash lookup decides and finds the slot to add to, for an
 * observed IP and an unobserved one alike, and the program never creates an entry. Packets counted
 * between the two removal steps belong to the leaving pod and are part of what it takes.
 * Built with -DPM_COUNTERS_LAZY (a benchmark reference only) it is the program of before, which created
 * the entry at an IP's first packet: a counters miss then cost a filter lookup too. */
static __always_inline int pm_count(struct __sk_buff *skb, const struct pm_addr *addr, __u32 direction)
{
	struct counter_key ckey = { .direction = direction };
	struct counter_value *value;

	__builtin_memcpy(ckey.addr, addr, sizeof(ckey.addr));
	value = bpf_map_lookup_elem(&counters, &ckey);
#ifdef PM_COUNTERS_LAZY
	if (!value)
		return pm_count_first(skb, addr, &ckey);
#endif
	if (!value)
		return 0;
	pm_add(value, skb);
	return 1;
}

#ifndef PM_NO_FLOWS
#ifdef PM_NO_CLOCK
#define pm_now() 0 /* benchmark reference: what the clock read costs */
#else
#define pm_now() bpf_ktime_get_coarse_ns()
#endif
#define PM_SRC_UNKNOWN 2 /* pm_flow's src_observed when the source was not looked up */

/* Whether a packet whose flow has no entry yet may create one (the fairness rule). Below the threshold
 * every packet may; past it, only one whose pod link (the hook's interface) created fewer than `share`
 * entries since the threshold was passed. Sets *past when the threshold is passed. Concurrent CPUs may
 * pass a link a few entries over its share: the rule bounds a pod, it does not meter it. */
static __always_inline int pm_flow_admit(const struct flows_fill *fill, __u32 link, int *past)
{
	__u64 *used;

	*past = 0;
	if (!fill || !fill->threshold || fill->entries < fill->threshold)
		return 1;
	*past = 1;
	used = bpf_map_lookup_elem(&flows_share, &link);
	return !used || *used < fill->share;
}

/* Account for an entry this packet created. A link flows_share has no room for is not limited: the
 * flows map itself still is. */
static __always_inline void pm_flow_created(struct flows_fill *fill, __u32 link, int past)
{
	if (!fill)
		return;
	__sync_fetch_and_add(&fill->entries, 1);
	if (past)
		pm_count_u64(&flows_share, &link, 1);
}

/* 40-byte keys, 8-byte aligned (both are: the stack key is declared so, map values always are). */
static __always_inline int pm_same_flow(const struct flow_key *a, const struct flow_key *b)
{
	const __u64 *x = (const __u64 *)a, *y = (const __u64 *)b;

	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3] && x[4] == y[4];
}

/* Count a packet the active flows map did not take in flows_lost, once per packet: at the observation
 * point that owns it, the same rule by which the workload series count each packet once per node
 * (model/flow_series.py). A packet between two pods of this node passes pm_from_pod (leaving the one) and
 * then pm_to_pod (entering the other), and both may fail to add it: it is lost at pm_from_pod, where it
 * was seen first. So pm_to_pod counts no packet
 * - whose source is observed: an observed address is a pod of this node, whose pm_from_pod saw it;
 * - that this CPU's pm_from_pod has just failed to add (flows_lost_seen holds its flow): from one pod's
 *   tc ingress to another's tc egress a packet is forwarded in one go, on one CPU;
 * - whose from-pod entry is in the active map: pm_from_pod added it, it is not lost.
 * What is left came from elsewhere (another node, the node itself, the world): this is its only point.
 * Packets refused by the fairness rule are lost the same way. */
static __always_inline void pm_flow_lost(struct __sk_buff *skb, void *active, struct flow_key *key,
					 const struct pm_packet *pkt, int src_observed)
{
	struct flows_lost_value *lost;
	struct flow_key *seen;
	__u32 zero = 0;

	seen = bpf_map_lookup_elem(&flows_lost_seen, &zero);
	if (key->observation == PM_OBS_FROM_POD) {
		if (seen)
			*seen = *key;
	} else {
		if (src_observed == 1)
			return;
		key->observation = PM_OBS_FROM_POD;
		if (seen && pm_same_flow(seen, key))
			return;
		if (active && bpf_map_lookup_elem(active, key))
			return;
		if (src_observed == PM_SRC_UNKNOWN && pm_observed(&pkt->src))
			return;
	}
	lost = bpf_map_lookup_elem(&flows_lost, &zero);
	if (lost) {
		lost->packets += 1; /* per-CPU slot, preemption off: plain adds are race-free */
		lost->bytes += skb->len;
	}
}

static __always_inline void pm_flow_key(struct flow_key *key, const struct pm_packet *pkt, __u8 observation)
{
	__builtin_memcpy(key->src, &pkt->src, sizeof(key->src));
	__builtin_memcpy(key->dst, &pkt->dst, sizeof(key->dst));
	key->sport = pkt->sport;
	key->dport = pkt->dport;
	key->protocol = pkt->protocol;
	key->observation = observation;
	key->pad[0] = 0;
	key->pad[1] = 0;
}

#ifdef PM_FLOW_FIRST
/* Benchmark bound: add the packet to its entry if the active map has one. */
static __always_inline int pm_flow_hit(struct __sk_buff *skb, const struct pm_packet *pkt, __u8 observation)
{
	struct flow_key key __attribute__((aligned(8)));
	__u32 zero = 0;
	void *active = bpf_map_lookup_elem(&flows, &zero);

	if (!active)
		return 0;
	pm_flow_key(&key, pkt, observation);
	return pm_flow_found(active, &key, skb->len, pm_now(), pkt->tcp_flags);
}
#endif

/* Add one packet to its flow entry in the active flows map; a packet that finds it full, or is refused
 * by the fairness rule (or finds no active map), is counted in flows_lost. src_observed: whether the
 * source is in the filter (0 or 1), or PM_SRC_UNKNOWN (pm_to_pod only needs it for a loss). */
static __always_inline int pm_flow(struct __sk_buff *skb, const struct pm_packet *pkt, __u8 observation,
				   int src_observed)
{
	struct flow_key key __attribute__((aligned(8)));
	struct flows_fill *fill;
	void *active;
	__u64 now = pm_now();
	__u32 zero = 0;
	__u32 link;
	int past;

	pm_flow_key(&key, pkt, observation);

	/* Looked up once: everything below goes to the same map, even if userspace flips the slot meanwhile
	 * (it then waits for this run to end before reading that map). */
	active = bpf_map_lookup_elem(&flows, &zero);
	if (!active)
		goto lost;
	if (pm_flow_found(active, &key, skb->len, now, pkt->tcp_flags))
		return 1;
	/* A new flow. */
	fill = bpf_map_lookup_elem(&flows_fill, &zero);
	link = skb->ifindex;
	if (pm_flow_admit(fill, link, &past)) {
		switch (pm_flow_create(active, &key, skb->len, now, pkt->tcp_flags)) {
		case PM_FLOW_CREATED:
			pm_flow_created(fill, link, past);
			return 1;
		case PM_FLOW_ADDED:
			return 1;
		}
	}
	/* E2BIG: the map is full until the next drain; or the pod has had its share. Never silent: */
lost:
	pm_flow_lost(skb, active, &key, pkt, src_observed);
	return 0;
}

/* A packet with an observed end, once the filter said so: its transport header (not read for a packet
 * nobody observes), then its flow. The one place for what is done to every kept packet, and only to
 * those. Returns 1 if the packet is in a flow entry, 0 if it was lost (flows_lost). */
static __always_inline int pm_keep(struct __sk_buff *skb, struct pm_packet *pkt, const struct pm_l4_at *at,
				   __u8 observation, int src_observed)
{
#ifndef PM_L4_EARLY
	pm_parse_l4(skb, pkt, at);
#endif
	return pm_flow(skb, pkt, observation, src_observed);
}
#endif /* PM_NO_FLOWS */

/* The network layer; the transport layer too in the benchmark references that read it first: with
 * -DPM_L4_EARLY, and counting alone (-DPM_NO_FLOWS), which needs no ports but reads them as it always did
 * (without them clang merges the IPv4 and IPv6 address reads into one through a register offset, which
 * the verifier refuses to a loader without CAP_PERFMON). */
static __always_inline int pm_parse_start(struct __sk_buff *skb, struct pm_packet *pkt, struct pm_l4_at *at)
{
	if (pm_parse_l3(skb, pkt, at) != 0)
		return -1;
#if defined(PM_L4_EARLY) || defined(PM_NO_FLOWS)
	pm_parse_l4(skb, pkt, at);
#endif
	return 0;
}

/* The pod is the source: count it (direction EGRESS). The flow is kept when the source is observed
 * (known from the counter path at no extra cost) or else when the destination is. */
SEC("tc")
int pm_from_pod(struct __sk_buff *skb)
{
	struct pm_packet pkt;
	struct pm_l4_at at;
	int observed;

	if (pm_parse_start(skb, &pkt, &at) != 0)
		return TC_ACT_UNSPEC;
#ifdef PM_FLOW_FIRST
	/* Benchmark bound: an existing flow entry alone, before any filter or counter lookup. */
	pm_parse_l4(skb, &pkt, &at);
	if (pm_flow_hit(skb, &pkt, PM_OBS_FROM_POD))
		return TC_ACT_UNSPEC;
#endif
#ifdef PM_COUNT_FROM_FLOWS
	/* Benchmark bound: the filter decides and the flow entry is the only update; the counter only when
	 * the flow was lost. */
	observed = pm_observed(&pkt.src);
	if ((observed || pm_observed(&pkt.dst)) && !pm_keep(skb, &pkt, &at, PM_OBS_FROM_POD, observed) && observed)
		pm_count(skb, &pkt.src, PM_DIR_EGRESS);
	return TC_ACT_UNSPEC;
#endif
	observed = pm_count(skb, &pkt.src, PM_DIR_EGRESS);
#ifndef PM_NO_FLOWS
	if (observed || pm_observed(&pkt.dst))
		pm_keep(skb, &pkt, &at, PM_OBS_FROM_POD, observed);
#else
	(void)observed;
#endif
	pm_dns_hook(skb, &pkt, observed, PM_OBS_FROM_POD);
	return TC_ACT_UNSPEC;
}

/* The pod is the destination: count it (direction INGRESS); the flow the same way, ends swapped. */
SEC("tc")
int pm_to_pod(struct __sk_buff *skb)
{
	struct pm_packet pkt;
	struct pm_l4_at at;
	int observed;
#ifndef PM_NO_FLOWS
	int src_observed;
#endif

	if (pm_parse_start(skb, &pkt, &at) != 0)
		return TC_ACT_UNSPEC;
	observed = pm_count(skb, &pkt.dst, PM_DIR_INGRESS);
#ifndef PM_NO_FLOWS
	src_observed = observed ? PM_SRC_UNKNOWN : pm_observed(&pkt.src);
	if (observed || src_observed)
		pm_keep(skb, &pkt, &at, PM_OBS_TO_POD, src_observed);
#else
	(void)observed;
#endif
	pm_dns_hook(skb, &pkt, observed, PM_OBS_TO_POD);
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
