/* SPDX-License-Identifier: GPL-2.0 */
/* What every podmeter BPF program shares: the includes, the codes userspace reads back (directions,
 * observation points), the IP protocol numbers, and podmeter's address, 16 bytes with IPv4 mapped.
 *
 * One header per concept, each included by every program that needs it:
 *   podmeter_common.h  this file;
 *   podmeter_maps.h    the agent's filter map (its key, the lookup) and create-or-retry, the one way an
 *                      entry is added to a hash map that more than one CPU adds to;
 *   podmeter_parse.h   the header parser of the TC programs;
 *   podmeter_flow.h    a flow entry: key, value, and the update of one (the TC programs' flows and the
 *                      drop tracer's dropped flows alike).
 * Codes and layouts are mirrored in podmeter/adapters/datapath/ebpf/layout.py (and drops.py), which
 * checks them against the built object's BTF at load (layout.check_object).
 */
#ifndef PODMETER_COMMON_H
#define PODMETER_COMMON_H

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define PM_DIR_INGRESS 0 /* into the pod: the observed address is the destination */
#define PM_DIR_EGRESS 1	 /* out of the pod: the observed address is the source */

#define PM_OBS_FROM_POD 0 /* pm_from_pod: tc ingress of the host-side veth */
#define PM_OBS_TO_POD 1	  /* pm_to_pod: tc egress of the host-side veth */

#define PM_PROTO_ICMP 1
#define PM_PROTO_TCP 6
#define PM_PROTO_UDP 17
#define PM_PROTO_ICMPV6 58
#define PM_IP_OFFSET_MASK 0x1FFF /* fragment offset bits of the IPv4 frag_off field (host order) */

#define PM_EEXIST 17 /* errno: what bpf_map_update_elem(BPF_NOEXIST) returns, negated, for a key present */

/* An address as podmeter keys it: 16 bytes, IPv6 as is, IPv4 mapped as ::ffff:a.b.c.d (network order).
 * Four words so that copies are cheap; keys hold byte arrays (bpftool prints them as bytes). */
struct pm_addr {
	__u32 word[4];
};

/* The IPv4 address be_addr (network order) as ::ffff:a.b.c.d. */
static __always_inline void pm_map_v4(struct pm_addr *out, __u32 be_addr)
{
	out->word[0] = 0;
	out->word[1] = 0;
	out->word[2] = bpf_htonl(0x0000ffff);
	out->word[3] = be_addr;
}

#endif /* PODMETER_COMMON_H */
