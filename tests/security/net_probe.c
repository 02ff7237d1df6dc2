/* What a hostile sandbox tries on the network (tests/security).
 *   net_probe tcp IP:PORT...      one line per target: "tcp IP:PORT open|refused|timeout|error E"
 *   net_probe udp N               N (<= 131070) datagrams, each to a distinct destination of
 *                                 198.18.0.0/15 (the benchmarking range, which the test
 *                                 blackholes on the host), port 9; prints "udp sent K"
 * Connects time out after 1 s; nothing is written to what it reaches. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static const char *try_tcp(const char *ip, int port) {
    static char buf[64];
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (inet_pton(AF_INET, ip, &a.sin_addr) != 1) return "error badaddr";
    int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (s < 0) return "error socket";
    int r = connect(s, (struct sockaddr *)&a, sizeof a);
    if (r == 0) { close(s); return "open"; }
    if (errno != EINPROGRESS) {
        int e = errno;
        close(s);
        if (e == ECONNREFUSED || e == ENETUNREACH || e == EHOSTUNREACH || e == EACCES || e == EPERM)
            return "refused";
        snprintf(buf, sizeof buf, "error %d", e);
        return buf;
    }
    struct pollfd p = {.fd = s, .events = POLLOUT};
    if (poll(&p, 1, 1000) <= 0) { close(s); return "timeout"; }
    int err = 0;
    socklen_t l = sizeof err;
    getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &l);
    close(s);
    if (err == 0) return "open";
    return "refused";
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 2 && strcmp(argv[1], "tcp") == 0) {
        for (int i = 2; i < argc; i++) {
            char ip[64];
            const char *colon = strrchr(argv[i], ':');
            if (!colon || colon - argv[i] >= (long)sizeof ip) { printf("tcp %s error arg\n", argv[i]); continue; }
            memcpy(ip, argv[i], colon - argv[i]);
            ip[colon - argv[i]] = 0;
            printf("tcp %s %s\n", argv[i], try_tcp(ip, atoi(colon + 1)));
        }
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "udp") == 0) {
        long n = atol(argv[2]), sent = 0;
        int s = socket(AF_INET, SOCK_DGRAM, 0);
        if (s < 0) { perror("socket"); return 1; }
        for (long i = 0; i < n; i++) {
            struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(9)};
            a.sin_addr.s_addr = htonl((198UL << 24) + (18UL << 16) + 1 + (unsigned long)(i % 131070));
            if (sendto(s, "x", 1, MSG_DONTWAIT, (struct sockaddr *)&a, sizeof a) == 1) sent++;
        }
        printf("udp sent %ld\n", sent);
        return 0;
    }
    fprintf(stderr, "usage: net_probe tcp IP:PORT... | net_probe udp N\n");
    return 2;
}
