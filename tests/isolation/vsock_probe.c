/* From inside a microVM: tries vsock connections to the host (CID 2) and to other CIDs on the
 * given ports and prints one verdict per attempt ("connected" or "refused <errno name>").
 * Nothing is sent on a connection that succeeds. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        unsigned cid = (unsigned)strtoul(argv[i], NULL, 10);
        unsigned port = (unsigned)strtoul(argv[i + 1], NULL, 10);
        int s = socket(AF_VSOCK, SOCK_STREAM, 0);
        if (s < 0) {
            printf("%u:%u socket %s\n", cid, port, strerror(errno));
            continue;
        }
        struct timeval tv = {.tv_sec = 3};
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        struct sockaddr_vm a = {.svm_family = AF_VSOCK, .svm_cid = cid, .svm_port = port};
        if (connect(s, (struct sockaddr *)&a, sizeof a) == 0)
            printf("%u:%u connected\n", cid, port);
        else
            printf("%u:%u refused %s\n", cid, port, strerror(errno));
        close(s);
    }
    return 0;
}
