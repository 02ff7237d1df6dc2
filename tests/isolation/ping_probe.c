/* What ping does without a raw socket (iputils falls back to it): an ICMP datagram socket,
 * allowed by net.ipv4.ping_group_range. Sends one echo request to the address in argv[1] and
 * prints "reply <type> <from> <payload matches>" or the error. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/ip_icmp.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv) {
    const char *to = argc > 1 ? argv[1] : "127.0.0.1";
    int s = socket(AF_INET, SOCK_DGRAM, IPPROTO_ICMP);
    if (s < 0) {
        printf("socket %s\n", strerror(errno));
        return 1;
    }
    struct timeval tv = {.tv_sec = 5};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    unsigned char pkt[8 + 9] = {ICMP_ECHO, 0};
    memcpy(pkt + 8, "cube-ping", 9);
    pkt[7] = 1; /* sequence 1; the kernel fills in the id and checksum */
    struct sockaddr_in a = {.sin_family = AF_INET};
    inet_pton(AF_INET, to, &a.sin_addr);
    if (sendto(s, pkt, sizeof pkt, 0, (struct sockaddr *)&a, sizeof a) < 0) {
        printf("send %s\n", strerror(errno));
        return 1;
    }
    unsigned char buf[256];
    struct sockaddr_in from;
    socklen_t fl = sizeof from;
    ssize_t n = recvfrom(s, buf, sizeof buf, 0, (struct sockaddr *)&from, &fl);
    if (n < 0) {
        printf("recv %s\n", strerror(errno));
        return 1;
    }
    printf("reply %d %s %s\n", buf[0], inet_ntoa(from.sin_addr),
           n == (ssize_t)sizeof pkt && memcmp(buf + 8, "cube-ping", 9) == 0 ? "True" : "False");
    return 0;
}
