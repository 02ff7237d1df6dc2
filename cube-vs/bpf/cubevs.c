// SPDX-License-Identifier: GPL-2.0
// CubeVS datapath: two tc direct-action programs attached to every sandbox's host-side
// interface (tap of a microVM or host end of a veth). One loaded object serves every
// sandbox; all per-sandbox state is keyed by the interface index.
//
//   cvs_from_guest  tc ingress on the host interface = packets the guest sends
//   cvs_to_guest    tc egress  on the host interface = packets delivered to the guest
//
// Every guest has the same fixed identity (cvs_cfg). The programs translate the fixed guest
// address <-> the sandbox's unique node-local host address, answer ARP on both sides, enforce
// the per-sandbox egress policy, and only let locally originated connections reach exposed
// ports. Anything unknown is dropped (fail closed): an attached but unbound interface passes
// nothing.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/in.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define PORT_BOUND 1
#define PORT_INTERNET 2
// 4 is PORT_TCX, userspace only.
#define PORT_NAMES 8 // TCP the rules deny goes to the node's egress proxy (names allowed)
#define PORT_DNS 16  // the resolver answers even with internet off (the names need it)

// skb->mark of a guest packet for the egress proxy: the node's nftables DNAT it there, and
// drop it should it ever be forwarded instead (see nft.rs).
#define PROXY_MARK 0x0cbe0001

#define VERDICT_DROP 0
#define VERDICT_PASS 1
#define VERDICT_PROXY 2

#define ACT_ALLOW 1
#define ACT_DENY 2

#define RULE_EXPLICIT 1     // from the policy, not a built-in default
#define RULE_HOST_SERVICE 2 // a /32 the operator opened on the node itself

// From linux/icmp.h, which drags in glibc headers that do not exist for -target bpf.
#define ICMP_ECHOREPLY 0
#define ICMP_DEST_UNREACH 3
#define ICMP_ECHO 8
#define ICMP_TIME_EXCEEDED 11

#define FLOW_BY_GUEST 1
#define FLOW_BY_NODE 2

#define ARP_REQUEST 1
#define ARP_REPLY 2

struct cfg {
	__u32 guest_ip; // network order
	__u32 gw_ip;
	__u32 pool_net;
	__u32 pool_mask;
	__u8 guest_mac[6];
	__u8 gw_mac[6];
	__u32 abi_version; // read by userspace only: refuses pins of an incompatible layout
};

struct port {
	__u32 host_ip;  // network order; 0 while unbound
	__u32 resolver; // network order; 0 = no DNS at all
	__u32 flags;
	__u32 policy_gen; // 0 or 1: which half of cvs_policy holds this port's rules (see below)
};

// A port's rules live under ifindex | policy_gen << 31. A replacement is written under the
// other generation, then one update of the port flips policy_gen: a packet sees the old rules
// or the new ones, never a mix.
struct policy_key {
	__u32 prefixlen; // 32 (ifindex and generation) + CIDR length
	__u32 ifindex;
	__u32 addr; // network order
};

#define POLICY_GEN_BIT 0x80000000u

struct policy_val {
	__u8 action;
	__u8 explicit_; // RULE_* bits
	__u8 plen;      // CIDR length of this entry
	__u8 pad;
};

struct exposed_key {
	__u32 ifindex;
	__u32 port; // host order
};

// Key within one port's flow table (the port is implied by the table).
struct flow_key {
	__u32 remote_ip;
	__u16 remote_port; // network order
	__u16 local_port;  // network order
	__u32 proto;
};

struct stats {
	__u64 from_packets;
	__u64 from_bytes;
	__u64 from_drops;
	__u64 to_packets;
	__u64 to_bytes;
	__u64 to_drops;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct cfg);
} cvs_cfg SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct port);
} cvs_ports SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 262144);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_key);
	__type(value, struct policy_val);
} cvs_policy SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct exposed_key);
	__type(value, __u32);
} cvs_exposed SEC(".maps");

// Conversations one side opened and the policy admitted, so that the other side's replies pass:
// UDP the guest opened (answers, DNS included, may come back), and TCP/UDP/ICMP the node opened
// towards an exposed port (the guest's answers to the node's own addresses, which the policy
// would otherwise refuse as host services). Key: the guest's view (remote = the peer).
//
// One LRU table per port (its size is the per-sandbox quota, SwitchConfig::flow_quota; userspace
// creates it at attach): a sandbox opening more flows than that recycles its own least recently
// used entries and can neither evict nor crowd out another sandbox's, as it could in one shared
// LRU table. A shared non-LRU table with per-port counters would need flow aging, which the
// datapath does not have, and would still fail for everyone once full.
struct flow_table {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096); // template only: each port's table is sized by userspace
	// Sizes, not __type: clang leaves a struct reached only through the outer map's pointer
	// array as a forward declaration, which has no size.
	__uint(key_size, sizeof(struct flow_key));
	__uint(value_size, sizeof(__u32)); // FLOW_BY_GUEST or FLOW_BY_NODE
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH_OF_MAPS);
	__uint(max_entries, 16384);
	__type(key, __u32); // ifindex
	__array(values, struct flow_table);
} cvs_port_flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32);
	__type(value, struct stats);
} cvs_stats SEC(".maps");

struct arp_eth {
	__be16 hrd;
	__be16 pro;
	__u8 hln;
	__u8 pln;
	__be16 op;
	__u8 sha[6];
	__be32 spa;
	__u8 tha[6];
	__be32 tpa;
} __attribute__((packed));

#define ETH_LEN 14
#define IP_OFF ETH_LEN
#define IP_CSUM_OFF (IP_OFF + 10)
#define IP_SRC_OFF (IP_OFF + 12)
#define IP_DST_OFF (IP_OFF + 16)

static __always_inline void count(__u32 ifindex, int from, int drop, __u32 len)
{
	struct stats *s = bpf_map_lookup_elem(&cvs_stats, &ifindex);
	if (!s)
		return;
	if (from) {
		if (drop) {
			__sync_fetch_and_add(&s->from_drops, 1);
		} else {
			__sync_fetch_and_add(&s->from_packets, 1);
			__sync_fetch_and_add(&s->from_bytes, len);
		}
	} else {
		if (drop) {
			__sync_fetch_and_add(&s->to_drops, 1);
		} else {
			__sync_fetch_and_add(&s->to_packets, 1);
			__sync_fetch_and_add(&s->to_bytes, len);
		}
	}
}

static __always_inline int is_ours(__u32 addr, const struct cfg *c)
{
	return (addr & c->pool_mask) == c->pool_net;
}

static __always_inline int mac_eq(const __u8 *a, const __u8 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3] && a[4] == b[4] &&
	       a[5] == b[5];
}

// Rewrite one IPv4 address (at ip_addr_off) and fix the IP and L4 checksums.
// l4_off < 0 means "no L4 header in this packet" (non-first fragment or ICMP).
static __always_inline int rewrite_addr(struct __sk_buff *skb, __u32 ip_addr_off, __be32 old,
					__be32 new, __u8 proto, int l4_off, int udp_csum_zero)
{
	if (l4_off >= 0) {
		if (proto == IPPROTO_TCP) {
			if (bpf_l4_csum_replace(skb, l4_off + 16, old, new,
						BPF_F_PSEUDO_HDR | sizeof(new)))
				return -1;
		} else if (proto == IPPROTO_UDP && !udp_csum_zero) {
			if (bpf_l4_csum_replace(skb, l4_off + 6, old, new,
						BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0 |
							sizeof(new)))
				return -1;
		}
	}
	if (bpf_l3_csum_replace(skb, IP_CSUM_OFF, old, new, sizeof(new)))
		return -1;
	if (bpf_skb_store_bytes(skb, ip_addr_off, &new, sizeof(new), 0))
		return -1;
	return 0;
}

struct l4info {
	int l4_off; // -1 when there is no L4 header
	__u8 proto;
	__be16 sport;
	__be16 dport;
	__u8 tcp_flags; // byte 13 of the TCP header
	__u8 icmp_type;
	int udp_csum_zero;
};

static __always_inline int parse_l4(struct __sk_buff *skb, struct iphdr *ip, struct l4info *l4)
{
	__u32 ihl = ip->ihl;
	l4->proto = ip->protocol;
	l4->l4_off = -1;
	l4->sport = 0;
	l4->dport = 0;
	l4->tcp_flags = 0;
	l4->icmp_type = 0;
	l4->udp_csum_zero = 0;
	if (ihl < 5)
		return -1;
	if (ip->frag_off & bpf_htons(0x1fff))
		return 0; // non-first fragment: no L4 header
	int off = IP_OFF + (int)(ihl & 0xf) * 4;
	if (l4->proto == IPPROTO_TCP) {
		__u8 hdr[14];
		if (bpf_skb_load_bytes(skb, off, hdr, sizeof(hdr)))
			return -1;
		__builtin_memcpy(&l4->sport, &hdr[0], 2);
		__builtin_memcpy(&l4->dport, &hdr[2], 2);
		l4->tcp_flags = hdr[13];
		l4->l4_off = off;
	} else if (l4->proto == IPPROTO_UDP) {
		__u8 hdr[8];
		if (bpf_skb_load_bytes(skb, off, hdr, sizeof(hdr)))
			return -1;
		__builtin_memcpy(&l4->sport, &hdr[0], 2);
		__builtin_memcpy(&l4->dport, &hdr[2], 2);
		l4->udp_csum_zero = hdr[6] == 0 && hdr[7] == 0;
		l4->l4_off = off;
	} else if (l4->proto == IPPROTO_ICMP) {
		__u8 hdr[2];
		if (bpf_skb_load_bytes(skb, off, hdr, sizeof(hdr)))
			return -1;
		l4->icmp_type = hdr[0];
		// ICMP's checksum does not cover the IP header: no L4 fix-up needed.
		l4->l4_off = -1;
	}
	return 0;
}

// Reply to an ARP request in place and send it back where it came from.
static __always_inline int arp_reply(struct __sk_buff *skb, const __u8 *mac, __be32 ip,
				     __u64 redirect_flags)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct arp_eth *arp = data + ETH_LEN;
	if ((void *)(arp + 1) > data_end)
		return TC_ACT_SHOT;
	__u8 req_mac[6];
	__be32 req_ip = arp->spa;
	__builtin_memcpy(req_mac, arp->sha, 6);
	__builtin_memcpy(eth->h_dest, req_mac, 6);
	__builtin_memcpy(eth->h_source, mac, 6);
	arp->op = bpf_htons(ARP_REPLY);
	__builtin_memcpy(arp->tha, req_mac, 6);
	arp->tpa = req_ip;
	__builtin_memcpy(arp->sha, mac, 6);
	arp->spa = ip;
	return bpf_redirect(skb->ifindex, redirect_flags);
}

static __always_inline struct arp_eth *arp_hdr(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct arp_eth *arp = data + ETH_LEN;
	if ((void *)(arp + 1) > data_end)
		return 0;
	if (arp->hrd != bpf_htons(1) || arp->pro != bpf_htons(ETH_P_IP) || arp->hln != 6 ||
	    arp->pln != 4)
		return 0;
	return arp;
}

// Verdict for a guest packet to daddr: VERDICT_*.
static __always_inline int egress_allowed(struct __sk_buff *skb, const struct cfg *c,
					  const struct port *p, __u32 ifindex, struct iphdr *ip,
					  const struct l4info *l4)
{
	__be32 daddr = ip->daddr;
	__u32 dh = bpf_ntohl(daddr);

	if (daddr == c->gw_ip || daddr == c->guest_ip)
		return VERDICT_DROP;
	if (is_ours(daddr, c))
		return VERDICT_DROP; // sandbox to sandbox, always
	if ((dh >> 24) == 0 || (dh >> 24) == 127 || dh >= 0xe0000000)
		return VERDICT_DROP; // "this" network, loopback, multicast, broadcast

	// DNS goes to the configured resolver only while internet is on or allowed names need it,
	// so that internet-off cannot be tunnelled through a recursive resolver; elsewhere only
	// to an address the user allowed explicitly (E2B's dnsServers).
	int dns = (l4->proto == IPPROTO_UDP || l4->proto == IPPROTO_TCP) && l4->l4_off >= 0 &&
		  l4->dport == bpf_htons(53);
	if (dns && p->resolver != 0 && daddr == p->resolver &&
	    (p->flags & (PORT_INTERNET | PORT_DNS)))
		return VERDICT_PASS;

	struct policy_key k = { .prefixlen = 64,
				.ifindex = ifindex | (p->policy_gen ? POLICY_GEN_BIT : 0),
				.addr = daddr };
	struct policy_val *v = bpf_map_lookup_elem(&cvs_policy, &k);
	if (!v || v->action != ACT_ALLOW) {
		// Denied by the default route or by the user's own deny: the proxy may still admit
		// it by name (an allowed name beats a deny, as in E2B). The built-in private ranges
		// stay dropped.
		if (!dns && l4->proto == IPPROTO_TCP && (p->flags & PORT_NAMES) &&
		    (!v || v->plen == 0 || (v->explicit_ & RULE_EXPLICIT)))
			return VERDICT_PROXY;
		return VERDICT_DROP;
	}
	if (dns && !(v->explicit_ & RULE_EXPLICIT))
		return VERDICT_DROP;

	// Anything the node itself would receive (its own addresses, local/broadcast routes) is a
	// host service: only a host-service /32 opens it, never an allow entry, however specific.
	struct bpf_fib_lookup fib = {};
	fib.family = 2; // AF_INET
	fib.l4_protocol = l4->proto;
	fib.sport = l4->sport;
	fib.dport = l4->dport;
	fib.ipv4_src = p->host_ip;
	fib.ipv4_dst = daddr;
	fib.ifindex = ifindex;
	long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH ||
	    rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return VERDICT_PASS;
	if (rc == BPF_FIB_LKUP_RET_BLACKHOLE || rc == BPF_FIB_LKUP_RET_UNREACHABLE ||
	    rc == BPF_FIB_LKUP_RET_PROHIBIT)
		return VERDICT_DROP;
	// NOT_FWDED (local), FWD_DISABLED (cannot tell; only local delivery is possible), errors.
	return ((v->explicit_ & RULE_HOST_SERVICE) && v->plen == 32) ? VERDICT_PASS : VERDICT_DROP;
}

SEC("classifier")
int cvs_from_guest(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	__u32 len = skb->len;
	__u32 zero = 0;
	struct cfg *c = bpf_map_lookup_elem(&cvs_cfg, &zero);
	struct port *p = bpf_map_lookup_elem(&cvs_ports, &ifindex);
	if (!c || !p)
		goto drop;

	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		goto drop;
	// Anti-spoofing, layer 2: every guest NIC has the fixed guest MAC (cubelet gives it to the
	// veth peer and to the microVM's NIC); anything else is not the sandbox speaking.
	if (!mac_eq(eth->h_source, c->guest_mac))
		goto drop;

	if (eth->h_proto == bpf_htons(ETH_P_ARP)) {
		struct arp_eth *arp = arp_hdr(skb);
		if (!arp)
			goto drop;
		// Our own answer for the host address (see cvs_to_guest), redirected to ingress.
		if (arp->op == bpf_htons(ARP_REPLY) && (p->flags & PORT_BOUND) &&
		    arp->spa == p->host_ip)
			goto pass;
		if (arp->op != bpf_htons(ARP_REQUEST) || arp->tpa != c->gw_ip ||
		    !mac_eq(arp->sha, c->guest_mac))
			goto drop;
		count(ifindex, 1, 0, len);
		return arp_reply(skb, c->gw_mac, c->gw_ip, 0);
	}
	if (eth->h_proto != bpf_htons(ETH_P_IP) || !(p->flags & PORT_BOUND))
		goto drop; // IPv6 and everything else: not supported, dropped

	struct iphdr *ip = data + ETH_LEN;
	if ((void *)(ip + 1) > data_end)
		goto drop;
	if (ip->saddr != c->guest_ip)
		goto drop; // anti-spoofing

	struct l4info l4;
	if (parse_l4(skb, ip, &l4))
		goto drop;

	// Attach creates the table before the port passes anything: none means not ours.
	void *flows = bpf_map_lookup_elem(&cvs_port_flows, &ifindex);
	if (!flows)
		goto drop;
	struct flow_key fk = { .remote_ip = ip->daddr,
			       .remote_port = l4.dport,
			       .local_port = l4.sport,
			       .proto = l4.proto };
	int syn_only = l4.proto == IPPROTO_TCP && (l4.tcp_flags & 0x02) && !(l4.tcp_flags & 0x10);
	__u32 *dir = bpf_map_lookup_elem(flows, &fk);
	if (!(dir && *dir == FLOW_BY_NODE && !syn_only && !is_ours(ip->daddr, c))) {
		// Not an answer to the node: the egress policy decides.
		int verdict = egress_allowed(skb, c, p, ifindex, ip, &l4);
		if (verdict == VERDICT_DROP)
			goto drop;
		if (verdict == VERDICT_PROXY)
			skb->mark = PROXY_MARK;
		if (l4.proto == IPPROTO_UDP && l4.l4_off >= 0 && !dir) {
			__u32 by = FLOW_BY_GUEST;
			bpf_map_update_elem(flows, &fk, &by, BPF_ANY);
		}
	}

	if (rewrite_addr(skb, IP_SRC_OFF, c->guest_ip, p->host_ip, l4.proto, l4.l4_off,
			 l4.udp_csum_zero))
		goto drop;
	// The guest addressed the gateway MAC, which the host interface does not own; without
	// this the stack would discard the frame as PACKET_OTHERHOST.
	bpf_skb_change_type(skb, 0 /* PACKET_HOST */);
pass:
	count(ifindex, 1, 0, len);
	return TC_ACT_OK;
drop:
	count(ifindex, 1, 1, len);
	return TC_ACT_SHOT;
}

SEC("classifier")
int cvs_to_guest(struct __sk_buff *skb)
{
	__u32 ifindex = skb->ifindex;
	__u32 len = skb->len;
	__u32 zero = 0;
	struct cfg *c = bpf_map_lookup_elem(&cvs_cfg, &zero);
	struct port *p = bpf_map_lookup_elem(&cvs_ports, &ifindex);
	if (!c || !p)
		goto drop;

	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		goto drop;

	if (eth->h_proto == bpf_htons(ETH_P_ARP)) {
		struct arp_eth *arp = arp_hdr(skb);
		if (!arp)
			goto drop;
		// Our own answer to the guest's request for the gateway (see cvs_from_guest).
		if (arp->op == bpf_htons(ARP_REPLY) && arp->spa == c->gw_ip)
			goto pass;
		// The host resolving the sandbox's host address: answer for the guest.
		if (arp->op == bpf_htons(ARP_REQUEST) && (p->flags & PORT_BOUND) &&
		    arp->tpa == p->host_ip) {
			count(ifindex, 0, 0, len);
			return arp_reply(skb, c->guest_mac, p->host_ip, BPF_F_INGRESS);
		}
		goto drop;
	}
	if (eth->h_proto != bpf_htons(ETH_P_IP) || !(p->flags & PORT_BOUND))
		goto drop;

	struct iphdr *ip = data + ETH_LEN;
	if ((void *)(ip + 1) > data_end)
		goto drop;
	if (ip->daddr != p->host_ip || is_ours(ip->saddr, c))
		goto drop;

	struct l4info l4;
	if (parse_l4(skb, ip, &l4))
		goto drop;
	// Locally originated packets (the node's edge/proxy) have no input interface.
	int local = skb->ingress_ifindex == 0;
	void *flows = bpf_map_lookup_elem(&cvs_port_flows, &ifindex);
	if (!flows)
		goto drop;
	struct flow_key fk = { .remote_ip = ip->saddr,
			       .remote_port = l4.sport,
			       .local_port = l4.dport,
			       .proto = l4.proto };
	struct exposed_key ek = { .ifindex = ifindex, .port = bpf_ntohs(l4.dport) };
	// Port 0 stands for every port (ANY_PORT): E2B's public ports, still node-originated only.
	struct exposed_key any = { .ifindex = ifindex, .port = 0 };
	__u32 by_node = FLOW_BY_NODE;
	if (l4.proto == IPPROTO_TCP) {
		if (l4.l4_off >= 0 && (l4.tcp_flags & 0x02) && !(l4.tcp_flags & 0x10)) {
			// A new connection: only from the node, only to an exposed port.
			if (!local || !(bpf_map_lookup_elem(&cvs_exposed, &ek) ||
					bpf_map_lookup_elem(&cvs_exposed, &any)))
				goto drop;
			bpf_map_update_elem(flows, &fk, &by_node, BPF_ANY);
		}
	} else if (l4.proto == IPPROTO_UDP) {
		if (l4.l4_off >= 0) {
			__u32 *dir = bpf_map_lookup_elem(flows, &fk);
			if (!(dir && *dir == FLOW_BY_GUEST)) {
				if (!local || !(bpf_map_lookup_elem(&cvs_exposed, &ek) ||
						bpf_map_lookup_elem(&cvs_exposed, &any)))
					goto drop;
				bpf_map_update_elem(flows, &fk, &by_node, BPF_ANY);
			}
		}
	} else if (l4.proto == IPPROTO_ICMP) {
		if (l4.icmp_type == ICMP_ECHO) {
			if (!local)
				goto drop;
			bpf_map_update_elem(flows, &fk, &by_node, BPF_ANY);
		} else if (l4.icmp_type != ICMP_ECHOREPLY && l4.icmp_type != ICMP_DEST_UNREACH &&
			   l4.icmp_type != ICMP_TIME_EXCEEDED) {
			goto drop;
		}
	} else {
		goto drop;
	}

	if (rewrite_addr(skb, IP_DST_OFF, p->host_ip, c->guest_ip, l4.proto, l4.l4_off,
			 l4.udp_csum_zero))
		goto drop;
	if (bpf_skb_store_bytes(skb, 0, c->guest_mac, 6, 0) ||
	    bpf_skb_store_bytes(skb, 6, c->gw_mac, 6, 0))
		goto drop;
pass:
	count(ifindex, 0, 0, len);
	return TC_ACT_OK;
drop:
	count(ifindex, 0, 1, len);
	return TC_ACT_SHOT;
}

char _license[] SEC("license") = "GPL";
