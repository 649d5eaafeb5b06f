#!/bin/bash
# Boot the TCG guest with the probe initrd (build.sh); console to stdout.
exec timeout ${TMO:-1500} qemu-system-x86_64 -machine q35 -accel tcg -cpu max -smp ${SMP:-1} -m 1024 \
  -nodefaults -nographic -no-reboot -serial stdio \
  -kernel /var/cache/devlend/guest/vmlinux -initrd "$(dirname "$0")/initrd.gz" \
  -append "console=ttyS0 quiet panic=-1"
