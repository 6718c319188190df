/* SPDX-License-Identifier: GPL-2.0 */
/* DNS per pod: the queries an observed pod sends and the answers it receives, read in the TC programs.
 *
 * Which packets: a packet leaving an observed pod (pm_from_pod) to port 53 is a query; a packet entering
 * an observed pod (pm_to_pod) from port 53 is a response. UDP, and TCP when the segment holds exactly
 * one whole message after its 2-byte length (a message split over segments, or two in one, is counted
 * in PM_DNS_TCP and not read). A pod that serves DNS is not metered as a server. Everything else pays
 * the port compare of pm_dns_hook only.
 *
 * What is read: the 12-byte header (id, QR, rcode, qdcount) and the first question, whose name is
 * walked label by label with a bounded loop; a compression pointer in the question is refused (a
 * question name is never compressed by a well-formed sender, and following one is how parsers loop).
 * Answers are not read. Every message is either aggregated whole or counted in one slot of
 * `dns_counts` (the reasons below), never read partly.
 *
 * Aggregation: `dns`, a hash map keyed by (pod, server, direction, qname, qtype, rcode, protocol), adds
 * the message count and, for responses, a latency histogram (PM_DNS_BUCKETS, 1 ms .. 5 s). The latency
 * is from `dns_pending`, an LRU map of outstanding queries (pod address, pod port, DNS id) -> the query's
 * time: the LRU bounds it under a flood of unanswered queries; a response finds and removes its query;
 * an answer later than PM_DNS_EXPIRE_NS has no latency (PM_DNS_EXPIRED), and userspace removes entries
 * that old, or of a pod that left the filter, at each drain. The agent drains `dns` with batched
 * lookup-and-delete at each flow drain.
 *
 * The name is the question's wire form (length-prefixed labels, the final zero included: at most 255
 * bytes, so a 253-character dotted name fits), zero-padded to 256 bytes; userspace decodes and lowercases.
 * Built with -DPM_NO_DNS (podmeter_nodns.bpf.c, the benchmark's reference) the hook is empty.
 * Layouts are mirrored in podmeter/adapters/datapath/ebpf/layout.py (DNS_KEY ...), slot codes too (DNS_COUNT_NAMES).
 */
#ifndef PODMETER_DNS_H
#define PODMETER_DNS_H

#include "podmeter_maps.h"
#include "podmeter_parse.h"

#define PM_DNS_PORT 53
#define PM_DNS_QUERY 0	  /* direction: a query the pod sent */
#define PM_DNS_RESPONSE 1 /* direction: a response the pod received */
#define PM_DNS_HEADER 12
#define PM_DNS_NAME_MAX 255   /* wire bytes of a name, its final zero included (RFC 1035 3.1) */
#define PM_DNS_NAME_BYTES 256 /* the key's room for it */
#define PM_DNS_LABEL_MAX 63
#define PM_DNS_LABELS 128 /* more labels than 255 bytes can hold: the walk's bound */
#define PM_DNS_BUCKETS 13	  /* 12 upper bounds (1 ms .. 5 s) and one above them */
#define PM_DNS_EXPIRE_NS 5000000000ULL
#define PM_MS 1000000ULL

/* Slots of `dns_counts` (per CPU): slot 0 counts messages aggregated, the others what was not. */
#define PM_DNS_PARSED 0
#define PM_DNS_TRUNCATED 1 /* the message ends before its header or question does */
#define PM_DNS_BAD_COUNT 2 /* qdcount != 1 */
#define PM_DNS_LABEL_LONG 3 /* a label length byte over 63 that is not a pointer (0x40, 0x80 forms) */
#define PM_DNS_POINTER 4    /* a compression pointer in the question */
#define PM_DNS_NAME_LONG 5  /* a name over 255 bytes */
#define PM_DNS_WRONG_QR 6   /* a response to port 53, or a query from it */
#define PM_DNS_TCP 7	    /* a TCP segment that is not exactly one message */
#define PM_DNS_FULL 8	    /* `dns` had no room: the message is not aggregated */
#define PM_DNS_PENDING_FULL 9 /* the query could not be remembered: its response will have no latency */
#define PM_DNS_EXPIRED 10   /* a response later than PM_DNS_EXPIRE_NS: aggregated without latency */
#define PM_DNS_UNMATCHED 11 /* a response without its query (none, or evicted): aggregated without latency */
#define PM_DNS_COUNTS 12
#define PM_DNS_SKIP 255	    /* not a message (a TCP segment without payload): nothing to count */

/* 296 bytes, no implicit padding (the hash covers every byte: `pad` and the name's tail are zero). */
struct dns_key {
	__u8 pod[16];	 /* the observed pod: same encoding as filter_key.addr */
	__u8 server[16]; /* the other end, as the pod sees it (a Service's address before NAT) */
	__u16 qtype;	 /* host byte order */
	__u8 rcode;	 /* the header's 4 bits; 0 for queries */
	__u8 direction;	 /* PM_DNS_QUERY or PM_DNS_RESPONSE */
	__u8 protocol;	 /* PM_PROTO_UDP or PM_PROTO_TCP */
	__u8 name_len;	 /* wire bytes of qname, its final zero included (1 .. 255) */
	__u8 pad[2];
	__u8 qname[PM_DNS_NAME_BYTES];
};

/* Shared by all CPUs: atomic adds. 128 bytes. */
struct dns_value {
	__u64 count;	     /* messages */
	__u64 latency_count; /* responses with a latency (their query was seen, in time) */
	__u64 latency_sum_ns;
	__u64 buckets[PM_DNS_BUCKETS]; /* latencies <= 1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000 ms, more */
};

/* 20 bytes: an outstanding query. */
struct dns_pending_key {
	__u8 pod[16];
	__u16 port; /* the pod's port, host order */
	__u16 id;   /* the DNS id, host order */
};

struct pm_dns_header {
	__be16 id;
	__be16 flags;
	__be16 qdcount;
	__be16 ancount;
	__be16 nscount;
	__be16 arcount;
};

#ifndef PM_NO_DNS
/* Preallocated; max_entries set by the loader (the names per node between two drains). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, struct dns_key);
	__type(value, struct dns_value);
} dns SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct dns_pending_key);
	__type(value, __u64); /* bpf_ktime_get_ns() of the query */
} dns_pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, PM_DNS_COUNTS);
	__type(key, __u32);
	__type(value, __u64);
} dns_counts SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct dns_key); /* the key being built: too big for the 512-byte stack */
} dns_scratch SEC(".maps");

static __always_inline void pm_dns_count(__u32 slot)
{
	__u64 *count = bpf_map_lookup_elem(&dns_counts, &slot);

	if (count)
		*count += 1; /* per-CPU slot, preemption off */
}

/* The offset of the DNS message in the frame and its length (by the IP header's lengths, so Ethernet
 * padding is not read as message). The frame parsed already: only its lengths are read again here. */
static __always_inline int pm_dns_locate(struct __sk_buff *skb, __u8 protocol, __u32 *offset, __u32 *length)
{
	__u32 off = ETH_HLEN, l4_len;
	__be16 proto, tcp_len;
	__u8 byte;

	if (bpf_skb_load_bytes(skb, 12, &proto, sizeof(proto)) < 0)
		return PM_DNS_SKIP;
#pragma unroll
	for (int i = 0; i < PM_MAX_VLAN_TAGS; i++) {
		if (proto != bpf_htons(ETH_P_8021Q) && proto != bpf_htons(ETH_P_8021AD))
			break;
		if (bpf_skb_load_bytes(skb, off + 2, &proto, sizeof(proto)) < 0)
			return PM_DNS_SKIP;
		off += sizeof(struct pm_vlan_hdr);
	}
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr ip;

		if (bpf_skb_load_bytes(skb, off, &ip, sizeof(ip)) < 0)
			return PM_DNS_SKIP;
		if (bpf_ntohs(ip.tot_len) < ip.ihl * 4)
			return PM_DNS_TRUNCATED;
		l4_len = bpf_ntohs(ip.tot_len) - ip.ihl * 4;
		off += ip.ihl * 4;
	} else if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr ip6;

		if (bpf_skb_load_bytes(skb, off, &ip6, sizeof(ip6)) < 0)
			return PM_DNS_SKIP;
		l4_len = bpf_ntohs(ip6.payload_len);
		off += sizeof(ip6);
	} else {
		return PM_DNS_SKIP;
	}
	if (off + l4_len > skb->len)
		return PM_DNS_TRUNCATED;
	if (protocol == PM_PROTO_UDP) {
		if (l4_len < sizeof(struct udphdr))
			return PM_DNS_TRUNCATED;
		*offset = off + sizeof(struct udphdr);
		*length = l4_len - sizeof(struct udphdr);
		return PM_DNS_PARSED;
	}
	if (bpf_skb_load_bytes(skb, off + 12, &byte, 1) < 0) /* data offset, in words */
		return PM_DNS_SKIP;
	if ((byte >> 4) * 4 < sizeof(struct tcphdr) || l4_len < (byte >> 4) * 4)
		return PM_DNS_SKIP;
	off += (byte >> 4) * 4;
	l4_len -= (byte >> 4) * 4;
	if (l4_len == 0)
		return PM_DNS_SKIP; /* SYN, ACK, FIN: no message */
	if (l4_len < 2 || bpf_skb_load_bytes(skb, off, &tcp_len, sizeof(tcp_len)) < 0)
		return PM_DNS_TCP;
	if (bpf_ntohs(tcp_len) != l4_len - 2)
		return PM_DNS_TCP;
	*offset = off + 2;
	*length = l4_len - 2;
	return PM_DNS_PARSED;
}

/* Read the header into *hdr and the first question into *key (qname, name_len, qtype); returns
 * PM_DNS_PARSED or the slot that says why not. The rules, in this order (model/dns.py mirrors them):
 * shorter than a header: truncated; qdcount != 1: bad count; then per label: past the message's end:
 * truncated; a zero: the end; 0xC0: pointer; over 63: label too long; the name past 255 bytes: too
 * long; and the 4 bytes of qtype and qclass past the end: truncated.
 * Each length byte is read from the packet with bpf_skb_load_bytes: indexing a copy at a variable
 * offset is pointer arithmetic the verifier refuses to a loader without CAP_PERFMON (the agent's). */
static __always_inline int pm_dns_question(struct __sk_buff *skb, __u32 offset, __u32 length,
					   struct dns_key *key, struct pm_dns_header *hdr)
{
	__u32 avail, pos = 0, name_len = 0, copy;
	__be16 qtype;

	if (length < PM_DNS_HEADER || bpf_skb_load_bytes(skb, offset, hdr, sizeof(*hdr)) < 0)
		return PM_DNS_TRUNCATED;
	if (bpf_ntohs(hdr->qdcount) != 1)
		return PM_DNS_BAD_COUNT;
	avail = length - PM_DNS_HEADER;
	offset += PM_DNS_HEADER;
#pragma clang loop unroll(disable)
	for (int i = 0; i < PM_DNS_LABELS; i++) {
		__u8 label;

		if (pos >= avail || bpf_skb_load_bytes(skb, offset + pos, &label, 1) < 0)
			return PM_DNS_TRUNCATED;
		if (label == 0) {
			name_len = pos + 1;
			break;
		}
		if ((label & 0xC0) == 0xC0)
			return PM_DNS_POINTER;
		if (label > PM_DNS_LABEL_MAX)
			return PM_DNS_LABEL_LONG;
		pos += label + 1;
		if (pos >= PM_DNS_NAME_MAX) /* the final zero would be byte 256 or later */
			return PM_DNS_NAME_LONG;
	}
	if (name_len == 0)
		return PM_DNS_NAME_LONG; /* the loop's bound: 128 labels do not fit in 255 bytes */
	if (name_len + 4 > avail || bpf_skb_load_bytes(skb, offset + name_len, &qtype, sizeof(qtype)) < 0)
		return PM_DNS_TRUNCATED;
	/* The same value (it is 1 .. 255 here) in a form whose bounds the verifier sees: clang knows them
	 * and would drop a plain check. */
	copy = name_len - 1;
	asm volatile("%0 &= 0xff" : "+r"(copy));
	copy += 1;
	key->qtype = bpf_ntohs(qtype);
	key->name_len = name_len;
	__builtin_memset(key->qname, 0, sizeof(key->qname));
	if (bpf_skb_load_bytes(skb, offset, key->qname, copy) < 0)
		return PM_DNS_TRUNCATED;
	return PM_DNS_PARSED;
}

/* Remember a query, or find (and forget) the query of a response: its latency in ns, or 0 if none. */
/* The question's walk as a global function: the verifier checks it once, on its own, so that its loop's
 * states and jumps do not add to those of the program that calls it (without CAP_PERFMON, the agent's
 * case, the whole program then exceeds the verifier's limit on a path's jumps). It reads the name and
 * qtype into the scratch key; the caller reads the header again for its id and flags. */
__noinline int pm_dns_question_walk(struct __sk_buff *skb, __u32 offset, __u32 length)
{
	struct pm_dns_header hdr;
	struct dns_key *key;
	__u32 zero = 0;

	key = bpf_map_lookup_elem(&dns_scratch, &zero);
	if (!key)
		return PM_DNS_SKIP;
	return pm_dns_question(skb, offset, length, key, &hdr);
}

static __always_inline __u64 pm_dns_latency(const struct dns_key *key, __u16 pod_port, __u16 id, int response)
{
	struct dns_pending_key pending = { .port = pod_port, .id = id };
	__u64 now = bpf_ktime_get_ns(), *sent, latency;

	__builtin_memcpy(pending.pod, key->pod, sizeof(pending.pod));
	if (!response) {
		if (bpf_map_update_elem(&dns_pending, &pending, &now, BPF_ANY) != 0)
			pm_dns_count(PM_DNS_PENDING_FULL);
		return 0;
	}
	sent = bpf_map_lookup_elem(&dns_pending, &pending);
	if (!sent) {
		pm_dns_count(PM_DNS_UNMATCHED);
		return 0;
	}
	latency = now - *sent;
	bpf_map_delete_elem(&dns_pending, &pending);
	if (latency > PM_DNS_EXPIRE_NS) {
		pm_dns_count(PM_DNS_EXPIRED);
		return 0;
	}
	return latency ? latency : 1; /* 0 means "none" */
}

/* Atomically add 1 to buckets[i] of a value: the offset an immediate of the instruction. Without
 * CAP_PERFMON the verifier refuses a pointer plus a scalar that is a different constant on each path
 * into the add, which is what clang makes of one add per bucket (it merges them); inline assembly with
 * a constant offset cannot be merged. */
#define PM_DNS_BUCKET_ADD(value, i)                                                                      \
	asm volatile("lock *(u64 *)(%0 + %1) += %2" ::"r"(value),                                      \
		     "i"(__builtin_offsetof(struct dns_value, buckets) + 8 * (i)), "r"(1ULL)           \
		     : "memory")

static __always_inline void pm_dns_add(struct dns_value *value, __u64 latency)
{
	__sync_fetch_and_add(&value->count, 1);
	if (!latency)
		return;
	__sync_fetch_and_add(&value->latency_count, 1);
	__sync_fetch_and_add(&value->latency_sum_ns, latency);
	if (latency <= 1 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 0);
	else if (latency <= 2 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 1);
	else if (latency <= 5 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 2);
	else if (latency <= 10 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 3);
	else if (latency <= 25 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 4);
	else if (latency <= 50 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 5);
	else if (latency <= 100 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 6);
	else if (latency <= 250 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 7);
	else if (latency <= 500 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 8);
	else if (latency <= 1000 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 9);
	else if (latency <= 2500 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 10);
	else if (latency <= 5000 * PM_MS)
		PM_DNS_BUCKET_ADD(value, 11);
	else
		PM_DNS_BUCKET_ADD(value, 12);
}

/* One DNS packet of an observed pod: parse, time, aggregate, or count why not. */
static __always_inline void pm_dns(struct __sk_buff *skb, const struct pm_packet *pkt, const int response)
{
	struct pm_dns_header hdr;
	struct dns_value empty = {};
	struct dns_value *value;
	struct dns_key *key;
	__u32 zero = 0, offset = 0, length = 0;
	__u64 latency;
	int verdict;
	long err;

	if (pkt->protocol != PM_PROTO_UDP && pkt->protocol != PM_PROTO_TCP)
		return;
	key = bpf_map_lookup_elem(&dns_scratch, &zero);
	if (!key)
		return;
	verdict = pm_dns_locate(skb, pkt->protocol, &offset, &length);
	if (verdict == PM_DNS_PARSED)
		verdict = pm_dns_question_walk(skb, offset, length);
	if (verdict == PM_DNS_PARSED && bpf_skb_load_bytes(skb, offset, &hdr, sizeof(hdr)) < 0)
		verdict = PM_DNS_TRUNCATED;
	if (verdict == PM_DNS_PARSED && (bpf_ntohs(hdr.flags) >> 15) != (response ? 1 : 0))
		verdict = PM_DNS_WRONG_QR;
	if (verdict != PM_DNS_PARSED) {
		if (verdict != PM_DNS_SKIP)
			pm_dns_count(verdict);
		return;
	}
	__builtin_memcpy(key->pod, response ? &pkt->dst : &pkt->src, sizeof(key->pod));
	__builtin_memcpy(key->server, response ? &pkt->src : &pkt->dst, sizeof(key->server));
	key->rcode = response ? bpf_ntohs(hdr.flags) & 0xF : 0;
	key->direction = response ? PM_DNS_RESPONSE : PM_DNS_QUERY;
	key->protocol = pkt->protocol;
	key->pad[0] = 0;
	key->pad[1] = 0;
	latency = pm_dns_latency(key, response ? pkt->dport : pkt->sport, bpf_ntohs(hdr.id), response);

	/* A new entry is inserted empty and then added to like any other (not created with the message in
	 * it): one pointer reaches the bucket's add, which the verifier requires without CAP_PERFMON. */
	value = bpf_map_lookup_elem(&dns, key);
	if (!value) {
		err = bpf_map_update_elem(&dns, key, &empty, BPF_NOEXIST);
		value = err == 0 || err == -PM_EEXIST ? bpf_map_lookup_elem(&dns, key) : 0;
		if (!value) {
			pm_dns_count(PM_DNS_FULL);
			return;
		}
	}
	pm_dns_add(value, latency);
	pm_dns_count(PM_DNS_PARSED);
}
#endif /* PM_NO_DNS */

/* The one call of each TC program, after its filter decision: `observed` is whether the pod end (the
 * source for pm_from_pod, the destination for pm_to_pod) is in the filter. A non-DNS packet pays one
 * port compare. */
static __always_inline void pm_dns_hook(struct __sk_buff *skb, const struct pm_packet *pkt, int observed,
					const int observation)
{
#ifndef PM_NO_DNS
	/* observed first: the ports are read only for a kept packet (pm_keep) */
	if (!observed)
		return;
	if (observation == PM_OBS_FROM_POD) {
		if (pkt->dport == PM_DNS_PORT)
			pm_dns(skb, pkt, 0);
	} else if (pkt->sport == PM_DNS_PORT) {
		pm_dns(skb, pkt, 1);
	}
#endif
}

#endif /* PODMETER_DNS_H */
