set -e
export LD_LIBRARY_PATH=/opt/lib
devlend-modprobe crc32_generic ib_core ib_uverbs udp_tunnel ip6_udp_tunnel rdma_rxe dummy
echo "GUEST kernel $(uname -r)"
/opt/bin/ip link add d0 type dummy
/opt/bin/ip addr add 10.9.0.1/24 dev d0
/opt/bin/ip link set d0 up
sleep 1
/opt/bin/rdma link add rxe0 type rxe netdev d0
/opt/bin/rdma link show
/opt/bin/ibv_devinfo -v -d rxe0 | grep -E 'hca_id|fw_ver|max_mr|max_mw|device_cap_flags|MEM_WINDOW|MEM_MGT|active_mtu|max_qp:' || true
/opt/bin/ibv_devinfo -v -d rxe0 | sed -n '/device_cap_flags/,/max_sge/p' || true
set +e
echo "GUEST rust rdma-sys check"
/opt/bin/mwcheck
echo "DEVLEND-RESULT mwcheck_rc=$?"
ARGS="$(cat /opt/args 2>/dev/null)"
echo "GUEST running mwtest $ARGS"
/opt/bin/mwtest $ARGS
echo "DEVLEND-RESULT mwtest_rc=$?"
case "$ARGS" in *-I*) echo "GUEST (interleaved run: second run skipped)";; *)
echo "GUEST second run: type-1 unbind with a NULL MR (as ibv_bind_mw(3) allows)"
MWTEST_NULL_MR_UNBIND=1 /opt/bin/mwtest -c 2>&1 | grep -E "t1 |Segmentation|FATAL" | head -8
echo "DEVLEND-RESULT null_mr_rc=$?";;
esac
echo "GUEST dmesg begin"
dmesg | grep -E 'rdma_rxe|rxe0|refcount_t|WARNING|segfault|rxe_pool|__rxe_cleanup|rxe_destroy_qp|rxe_requester' | head -40
echo "GUEST dmesg end"
