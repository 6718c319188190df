// SPDX-License-Identifier: GPL-2.0
/* podmeter's packet counter, attached to the host side of each pod veth.
 *
 * On the host-side end of a pod's veth, tc ingress sees packets leaving the pod and tc egress sees
 * packets entering it. So pm_from_pod (tc ingress) counts direction EGRESS keyed on the source address,
 * and pm_to_pod (tc egress) counts direction INGRESS keyed on the destination address. Only addresses
 * present in the `filter` map are counted. Both programs return TC_ACT_UNSPEC: they never change a
 * verdict, so tc filters of other tools after them keep running (under TCX, TC_ACT_OK would stop them).
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

static __always_inline void pm_add(struct counter_value *value, struct __sk_buff *skb)
{
	/* Per-CPU value and tc runs with preemption off: plain adds are race-free. */
	value->packets += 1;
	value->bytes += skb->len;
}

/* Count one packet for addr if addr is in the filter.
 *
 * Invariant (kept together with userspace): a counters entry exists only while its IP is in the filter.
 * Userspace removes an IP in two steps, delete from filter then take (read and delete) its counters,
 * and this program never creates an entry for an IP that has left the filter. So the hot path of an
 * observed IP is a single hash lookup; the LPM trie is consulted only when no entry exists yet. Packets
 * counted between the two userspace steps belong to the leaving pod and are part of what it takes. */
static __always_inline void pm_count(struct __sk_buff *skb, const struct pm_addr *addr, __u32 direction)
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
		return;
	}
	if (!bpf_map_lookup_elem(&filter, &fkey))
		return;
	if (bpf_map_update_elem(&counters, &ckey, &first, BPF_NOEXIST) == 0) {
		/* If userspace deleted the IP and took its counters between our filter lookup and this
		 * insert, the new entry would outlive the pod (and break the invariant). Re-check the
		 * filter and drop the entry if the IP has gone: one packet of a deleted pod is lost. */
		if (!bpf_map_lookup_elem(&filter, &fkey))
			bpf_map_delete_elem(&counters, &ckey);
		return;
	}
	/* EEXIST: another CPU created the entry meanwhile and our CPU's slot exists now. E2BIG (map full)
	 * leaves the packet uncounted. */
	value = bpf_map_lookup_elem(&counters, &ckey);
	if (value)
		pm_add(value, skb);
}

SEC("tc")
int pm_from_pod(struct __sk_buff *skb)
{
	struct pm_addrs addrs;

	if (pm_parse(skb, &addrs) == 0)
		pm_count(skb, &addrs.src, PM_DIR_EGRESS);
	return TC_ACT_UNSPEC;
}

SEC("tc")
int pm_to_pod(struct __sk_buff *skb)
{
	struct pm_addrs addrs;

	if (pm_parse(skb, &addrs) == 0)
		pm_count(skb, &addrs.dst, PM_DIR_INGRESS);
	return TC_ACT_UNSPEC;
}

char LICENSE[] SEC("license") = "GPL";
