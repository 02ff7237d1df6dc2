"""PID 1 inside L1: runs the plan, reaps every orphan (cube's daemons and shims double-fork,
and the tests check that processes are gone), then powers L1 off."""

import os
import sys
import time

plan = os.fork()
if plan == 0:
    os.execv(sys.argv[1], sys.argv[1:])
rc = 1
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == plan:
        rc = os.waitstatus_to_exitcode(status)
        break
print(f"nested: plan exited with {rc}; powering off", flush=True)
os.sync()
with open("/proc/sysrq-trigger", "w") as f:
    f.write("o")
# The power-off runs asynchronously; PID 1 must not exit before it (that is a panic).
time.sleep(120)
