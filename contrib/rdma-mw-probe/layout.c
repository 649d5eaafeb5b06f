#include <infiniband/verbs.h>
#include <stddef.h>
#include <stdio.h>
int main(void)
{
	printf("LAYOUT C    sizeof(ibv_send_wr)=%zu off(wr)=%zu off(qp_type)=%zu off(bind_mw)=%zu off(invalidate_rkey)=%zu\n",
	       sizeof(struct ibv_send_wr), offsetof(struct ibv_send_wr, wr), offsetof(struct ibv_send_wr, qp_type),
	       offsetof(struct ibv_send_wr, bind_mw), offsetof(struct ibv_send_wr, invalidate_rkey));
	printf("LAYOUT C    off(bind_mw.rkey)-off(bind_mw)=%zu off(bind_mw.bind_info)-off(bind_mw)=%zu sizeof(ibv_mw_bind_info)=%zu\n",
	       offsetof(struct ibv_send_wr, bind_mw.rkey) - offsetof(struct ibv_send_wr, bind_mw),
	       offsetof(struct ibv_send_wr, bind_mw.bind_info) - offsetof(struct ibv_send_wr, bind_mw),
	       sizeof(struct ibv_mw_bind_info));
	printf("LAYOUT C    sizeof(ibv_wc)=%zu off(wc_flags)=%zu off(invalidated_rkey)=%zu\n",
	       sizeof(struct ibv_wc), offsetof(struct ibv_wc, wc_flags), offsetof(struct ibv_wc, invalidated_rkey));
	printf("LAYOUT C    sizeof(ibv_mw)=%zu off(rkey)=%zu off(type)=%zu sizeof(ibv_mw_bind)=%zu\n",
	       sizeof(struct ibv_mw), offsetof(struct ibv_mw, rkey), offsetof(struct ibv_mw, type), sizeof(struct ibv_mw_bind));
	return 0;
}
