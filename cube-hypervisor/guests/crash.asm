; Raises #UD with no IDT gate installed: the vCPU triple-faults (KVM_EXIT_SHUTDOWN).
%include "abi.inc"
org LOAD
start:
    PARK_APS
    SIGNAL PORT_CHECKPOINT, 1
    ud2
