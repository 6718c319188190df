/* bench.multicore's UDP sender: sends small datagrams from one socket as fast as sendmmsg(2) allows for a
 * given time, then prints how many the kernel accepted. A compiled loop, so that the kernel's path (the
 * pod's veth, the node's forwarding, podmeter's programs) is most of each packet's cost, not Python.
 *
 *   multicore_sender SRC_IP SRC_PORT DST_IP DST_PORT SECONDS PAYLOAD_BYTES
 *
 * The socket has SO_REUSEPORT: two senders in one pod may share a source port (one flow). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define BATCH 64

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int address(struct sockaddr_in *out, const char *ip, const char *port)
{
	memset(out, 0, sizeof(*out));
	out->sin_family = AF_INET;
	out->sin_port = htons((unsigned short)atoi(port));
	return inet_pton(AF_INET, ip, &out->sin_addr) == 1 ? 0 : -1;
}

int main(int argc, char **argv)
{
	static char payload[1500];
	struct mmsghdr messages[BATCH];
	struct sockaddr_in src, dst;
	struct iovec iov;
	unsigned long long sent = 0;
	double deadline;
	int fd, one = 1;

	if (argc != 7 || address(&src, argv[1], argv[2]) || address(&dst, argv[3], argv[4])) {
		fprintf(stderr, "usage: %s SRC_IP SRC_PORT DST_IP DST_PORT SECONDS PAYLOAD_BYTES\n", argv[0]);
		return 2;
	}
	fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) ||
	    bind(fd, (struct sockaddr *)&src, sizeof(src)) || connect(fd, (struct sockaddr *)&dst, sizeof(dst))) {
		perror("socket");
		return 1;
	}
	iov.iov_base = payload;
	iov.iov_len = (size_t)atoi(argv[6]) < sizeof(payload) ? (size_t)atoi(argv[6]) : sizeof(payload);
	memset(messages, 0, sizeof(messages));
	for (int i = 0; i < BATCH; i++) {
		messages[i].msg_hdr.msg_iov = &iov;
		messages[i].msg_hdr.msg_iovlen = 1;
	}
	deadline = now() + atof(argv[5]);
	while (now() < deadline) {
		for (int i = 0; i < 16; i++) {
			int n = sendmmsg(fd, messages, BATCH, 0);

			if (n > 0)
				sent += (unsigned long long)n;
		}
	}
	printf("%llu\n", sent);
	return 0;
}
