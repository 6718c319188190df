/* SPDX-License-Identifier: GPL-2.0 */
/* A flow entry: packets of one flow added up in place, in a hash map shared by all CPUs.
 *
 * The TC programs keep one entry per flow and observation point (struct flow_key, podmeter.bpf.c's
 * flows maps); the drop tracer one per dropped flow and reason (podmeter_drops.bpf.c's drop_flows). Both
 * values are a struct flow_value, added to the same way: pm_flow_found for the common case (the entry
 * exists), pm_flow_create for a new one (create-or-retry, podmeter_maps.h).
 */
#ifndef PODMETER_FLOW_H
#define PODMETER_FLOW_H

#include "podmeter_maps.h"

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
	__u64 first_ns; /* the program's clock (TC: bpf_ktime_get_coarse_ns(), CLOCK_MONOTONIC, coarse) */
	__u64 last_ns;	/* ... of the latest packet (within a clock tick under concurrent updates) */
	__u64 tcp_flags; /* OR of the TCP flags bytes (low 8 bits). 64 bits because a 32-bit atomic OR
			  * needs -mcpu=v3, a 64-bit one does not. */
};

#define PM_FLOW_LOST 0	  /* the map had no room: count the packet as lost */
#define PM_FLOW_ADDED 1	  /* added to an entry another CPU created meanwhile */
#define PM_FLOW_CREATED 2 /* a new entry, this packet in it */

static __always_inline void pm_flow_add(struct flow_value *value, __u64 len, __u64 now, __u8 tcp_flags)
{
#ifdef PM_FLOWS_PERCPU
	/* Benchmark reference: a per-CPU value, preemption off: plain adds. */
	value->packets += 1;
	value->bytes += len;
	if (now > value->last_ns)
		value->last_ns = now;
	value->tcp_flags |= tcp_flags;
	return;
#endif
	__sync_fetch_and_add(&value->packets, 1);
	__sync_fetch_and_add(&value->bytes, len);
	/* The coarse clock moves once a tick: most packets skip the store, and the cache line stays shared
	 * longer. Two CPUs racing here may leave the earlier of two times one tick apart. */
	if (now > value->last_ns)
		value->last_ns = now;
	if ((value->tcp_flags & tcp_flags) != tcp_flags)
		__sync_fetch_and_or(&value->tcp_flags, (__u64)tcp_flags);
}

/* Add one packet to its entry in `map` if the entry exists (1), else 0. The hot path. */
static __always_inline int pm_flow_found(void *map, const void *key, __u64 len, __u64 now, __u8 tcp_flags)
{
	struct flow_value *value = bpf_map_lookup_elem(map, key);

	if (!value)
		return 0;
	pm_flow_add(value, len, now, tcp_flags);
	return 1;
}

/* The entry of a packet whose lookup found none: created with this packet, or added to if another CPU
 * created it meanwhile (create-or-retry). Returns PM_FLOW_CREATED, PM_FLOW_ADDED or PM_FLOW_LOST. */
static __always_inline int pm_flow_create(void *map, const void *key, __u64 len, __u64 now, __u8 tcp_flags)
{
	struct flow_value first = {
		.packets = 1,
		.bytes = len,
		.first_ns = now,
		.last_ns = now,
		.tcp_flags = tcp_flags,
	};
	struct flow_value *value;
	int lost;

	value = pm_create(map, key, &first, &lost);
	if (value) {
		pm_flow_add(value, len, now, tcp_flags);
		return PM_FLOW_ADDED;
	}
	return lost ? PM_FLOW_LOST : PM_FLOW_CREATED;
}

#endif /* PODMETER_FLOW_H */
