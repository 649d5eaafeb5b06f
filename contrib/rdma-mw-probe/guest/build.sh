#!/bin/bash
# Build the per-test cpio (appended to devlend's cached base initrd) and boot.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
args="${1:-}"
G=/var/cache/devlend/guest
st=$(mktemp -d)
mkdir -p $st/opt/bin $st/opt/lib $st/etc/libibverbs.d $st/usr/lib/x86_64-linux-gnu/libibverbs
cp $here/test.sh $st/test.sh
echo "$args" > $st/opt/args
for b in $here/../mwtest /usr/bin/rdma /usr/sbin/ip /usr/bin/ibv_devinfo; do
  cp $b $st/opt/bin/
  ldd $b | awk '/=>/ {print $3}' | xargs -r -I{} cp -L {} $st/opt/lib/
done
cp /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so $st/usr/lib/x86_64-linux-gnu/libibverbs/
cp /etc/libibverbs.d/rxe.driver $st/etc/libibverbs.d/
mkdir -p $st/lib64 && cp -L /lib64/ld-linux-x86-64.so.2 $st/lib64/
( cd $st && find . | cpio -o -H newc 2>/dev/null ) > $here/extra.cpio
cp $G/initrd.gz $here/initrd.gz
# pad base to 4 bytes then append
sz=$(stat -c %s $here/initrd.gz); pad=$(( (4 - sz % 4) % 4 ))
head -c $pad /dev/zero >> $here/initrd.gz
cat $here/extra.cpio >> $here/initrd.gz
rm -rf $st
