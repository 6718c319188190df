// SPDX-License-Identifier: GPL-2.0
/* Benchmark reference: podmeter's TC programs without DNS parsing (no `dns` maps, an empty pm_dns_hook),
 * the same source built with PM_NO_DNS. bench/dns.py runs it next to podmeter.bpf.o on the same frames;
 * the difference is what DNS parsing costs a packet that is not DNS. The agent never loads this object. */
#define PM_NO_DNS
#include "podmeter.bpf.c"
