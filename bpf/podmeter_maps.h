/* SPDX-License-Identifier: GPL-2.0 */
/* Maps every program shares, and the one way an entry is added to a hash map from several CPUs.
 *
 * `filter` is the agent's set of observed IPs (docs/datapath.md). The counting object creates and pins
 * it; the drop tracer's object declares the same map and is loaded against the pinned one
 * (bpf_map__reuse_fd), so both read exactly the IPs the agent observes.
 */
#ifndef PODMETER_MAPS_H
#define PODMETER_MAPS_H

#include "podmeter_common.h"

/* Addresses in keys are byte arrays (not struct pm_addr's words) so that `bpftool map dump` prints them
 * as readable bytes, e.g. IPv4 10.244.1.7 as [0,0,0,0,0,0,0,0,0,0,255,255,10,244,1,7]. */
struct filter_key {
	__u32 prefixlen; /* always 128: one host address per entry */
	__u8 addr[16];
};

/* An exact-match hash: the agent only ever stores host addresses (prefixlen 128), and a hash lookup
 * costs less than an LPM trie's walk down 128 bits (bench.flows measures both). The key keeps the LPM
 * trie's layout (the prefixlen word, always 128) so that an older agent's pinned trie migrates entry by
 * entry. Built with -DPM_FILTER_LPM (a benchmark reference only) it is the LPM trie of before.
 * max_entries is a default; the loader sets it from --filter-map-size before loading. */
struct {
#ifdef PM_FILTER_LPM
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
#else
	__uint(type, BPF_MAP_TYPE_HASH);
#endif
	__uint(max_entries, 255);
	__type(key, struct filter_key);
	__type(value, __u8);
	__uint(map_flags, BPF_F_NO_PREALLOC);
} filter SEC(".maps");

/* Whether addr is observed (in the filter). */
static __always_inline int pm_observed(const struct pm_addr *addr)
{
	struct filter_key fkey = { .prefixlen = 128 };

	__builtin_memcpy(fkey.addr, addr, sizeof(fkey.addr));
	return bpf_map_lookup_elem(&filter, &fkey) != 0;
}

/* Create-or-retry: the slow half of "add this event to the entry at key", once a lookup found none.
 * Inserts `first` (the entry as this event alone makes it) with BPF_NOEXIST.
 * - Inserted: returns NULL, *lost = 0. The event is counted, nothing is left to add.
 * - Another CPU inserted the key meanwhile (EEXIST): returns that entry, *lost = 0. Add the event to it.
 * - No room (E2BIG: a full map) or another refusal: returns NULL, *lost = 1. Count the loss somewhere.
 * The caller adds to the entry its own way (plain adds on a per-CPU value, atomic adds on a shared one). */
static __always_inline void *pm_create(void *map, const void *key, const void *first, int *lost)
{
	long err = bpf_map_update_elem(map, key, first, BPF_NOEXIST);
	void *entry = 0;

	if (err == -PM_EEXIST)
		entry = bpf_map_lookup_elem(map, key);
	*lost = err != 0 && !entry;
	return entry;
}

/* The whole of it: the entry at key to add the event to, creating it from `first` if there is none
 * (NULL: created with the event in it, or lost: see pm_create). */
static __always_inline void *pm_upsert(void *map, const void *key, const void *first, int *lost)
{
	void *entry = bpf_map_lookup_elem(map, key);

	if (entry) {
		*lost = 0;
		return entry;
	}
	return pm_create(map, key, first, lost);
}

/* Add `value` to the u64 at `key` of a hash map of u64 counts (atomic: shared by all CPUs), creating it.
 * Returns 1 if it was added, 0 if the map had no room. */
static __always_inline int pm_count_u64(void *map, const void *key, __u64 value)
{
	int lost;
	__u64 *count = pm_upsert(map, key, &value, &lost);

	if (count)
		__sync_fetch_and_add(count, value);
	return !lost;
}

#endif /* PODMETER_MAPS_H */
