/*
 * mwtest: can a borrower bound a lender's remote access to the buffers of one
 * request, with memory windows (type 2 / type 1) or per-request MRs, on rxe?
 *
 * One process, two device contexts (two uverbs fds), two PDs: the "owner"
 * (borrower: holds the 16 MiB "guest RAM" buffer) and the "peer" (lender).
 * Each check builds a fresh RC QP pair (an access error puts both QPs into
 * the error state), connected over the rxe device to itself (loopback GID).
 *
 * Output: one line per check "CHECK <name> PASS|FAIL <detail>", one line per
 * measurement "BENCH <name> iters=N us_per=X", and "INFO" lines.
 *
 * Usage: mwtest [-d rxe0] [-g gid_index] [-n iters]
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <infiniband/verbs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BUF_SIZE (16u << 20)
#define PEER_BUF (2u << 20)
#define MSG_SIZE 64
#define SLICE_OFF (4u << 20) /* the request's slice starts 4 MiB into "guest RAM" */

static const char *devname = "rxe0";
static int gid_index = -1;
static int iters = 10000;
static int reps = 1;
static int interleaved;
static int fails;

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	char *buf;           /* owner: 16 MiB guest RAM; peer: lender bounce buffer */
	size_t buf_len;
	struct ibv_mr *mr;   /* owner: LOCAL_WRITE|MW_BIND only; peer: local only */
	char *msg;           /* message buffers (send at 0, recv at 4096..) */
	struct ibv_mr *msg_mr;
	union ibv_gid gid;
};

struct pair {
	struct ibv_cq *cq_o, *cq_p;
	struct ibv_qp *qp_o, *qp_p;
};

static struct side O, P;

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void check(const char *name, int ok, const char *fmt, ...)
{
	va_list ap;
	static double t_start;
	if (!t_start)
		t_start = now_us();
	printf("CHECK %-44s %s ", name, ok ? "PASS" : "FAIL");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf(" [t=%.1fs]\n", (now_us() - t_start) / 1e6);
	fflush(stdout);
	if (!ok)
		fails++;
}

static void die(const char *what)
{
	printf("FATAL %s: errno=%d (%s)\n", what, errno, strerror(errno));
	fflush(stdout);
	exit(2);
}

/* Poll one completion; returns 0 and fills wc, or -1 on timeout. */
static int poll1(struct ibv_cq *cq, struct ibv_wc *wc, int timeout_ms)
{
	double end = now_us() + timeout_ms * 1000.0;
	for (;;) {
		int n = ibv_poll_cq(cq, 1, wc);
		if (n < 0)
			die("ibv_poll_cq");
		if (n == 1)
			return 0;
		if (timeout_ms >= 0 && now_us() > end)
			return -1;
	}
}

static void open_side(struct side *s, size_t len, int owner)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0]) {
		errno = ENODEV;
		die("ibv_get_device_list");
	}
	for (int i = 0; list[i]; i++)
		if (!strcmp(ibv_get_device_name(list[i]), devname))
			s->ctx = ibv_open_device(list[i]);
	ibv_free_device_list(list);
	if (!s->ctx)
		die("ibv_open_device");
	s->pd = ibv_alloc_pd(s->ctx);
	if (!s->pd)
		die("ibv_alloc_pd");
	s->buf_len = len;
	if (posix_memalign((void **)&s->buf, 4096, len))
		die("posix_memalign");
	memset(s->buf, owner ? 'G' : 'L', len);
	int acc = IBV_ACCESS_LOCAL_WRITE | (owner ? IBV_ACCESS_MW_BIND : 0);
	s->mr = ibv_reg_mr(s->pd, s->buf, len, acc);
	if (!s->mr)
		die("ibv_reg_mr(buffer)");
	if (posix_memalign((void **)&s->msg, 4096, 65536))
		die("posix_memalign");
	memset(s->msg, 0, 65536);
	s->msg_mr = ibv_reg_mr(s->pd, s->msg, 65536, IBV_ACCESS_LOCAL_WRITE);
	if (!s->msg_mr)
		die("ibv_reg_mr(msg)");
	if (ibv_query_gid(s->ctx, 1, gid_index, &s->gid))
		die("ibv_query_gid");
}

static struct ibv_qp *mkqp(struct side *s, struct ibv_cq *cq)
{
	struct ibv_qp_init_attr ia = {
		.send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 256, .max_recv_wr = 256,
			 .max_send_sge = 1, .max_recv_sge = 1 },
	};
	struct ibv_qp *qp = ibv_create_qp(s->pd, &ia);
	if (!qp)
		die("ibv_create_qp");
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .pkey_index = 0,
		.port_num = 1,
		.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			  IBV_QP_ACCESS_FLAGS))
		die("modify INIT");
	return qp;
}

static void connect_qp(struct ibv_qp *qp, struct side *s, uint32_t dqpn)
{
	struct ibv_qp_attr a = {
		.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
		.dest_qp_num = dqpn, .rq_psn = 1, .max_dest_rd_atomic = 16,
		.min_rnr_timer = 1,
		.ah_attr = { .is_global = 1, .port_num = 1,
			     .grh = { .dgid = s->gid, .sgid_index = gid_index,
				      .hop_limit = 64 } },
	};
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
			  IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
			  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("modify RTR");
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = 1;
	a.max_rd_atomic = 16;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			  IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
			  IBV_QP_MAX_QP_RD_ATOMIC))
		die("modify RTS");
}

static void post_recv(struct side *s, struct ibv_qp *qp, int n)
{
	for (int i = 0; i < n; i++) {
		struct ibv_sge sge = { (uintptr_t)s->msg + 4096, MSG_SIZE, s->msg_mr->lkey };
		struct ibv_recv_wr wr = { .wr_id = 100, .sg_list = &sge, .num_sge = 1 }, *bad;
		if (ibv_post_recv(qp, &wr, &bad))
			die("ibv_post_recv");
	}
}

static void pair_up(struct pair *p)
{
	p->cq_o = ibv_create_cq(O.ctx, 512, NULL, NULL, 0);
	p->cq_p = ibv_create_cq(P.ctx, 512, NULL, NULL, 0);
	if (!p->cq_o || !p->cq_p)
		die("ibv_create_cq");
	p->qp_o = mkqp(&O, p->cq_o);
	p->qp_p = mkqp(&P, p->cq_p);
	connect_qp(p->qp_o, &P, p->qp_p->qp_num);
	connect_qp(p->qp_p, &O, p->qp_o->qp_num);
	post_recv(&O, p->qp_o, 200);
	post_recv(&P, p->qp_p, 200);
}

static void pair_down(struct pair *p)
{
	ibv_destroy_qp(p->qp_o);
	ibv_destroy_qp(p->qp_p);
	ibv_destroy_cq(p->cq_o);
	ibv_destroy_cq(p->cq_p);
}

static const char *st(int s) { return ibv_wc_status_str(s); }

/* Post one WR on qp and wait for its completion on cq; returns wc status, or
 * -errno if the post failed, or -1000 on timeout. */
static int post_wait(struct ibv_qp *qp, struct ibv_cq *cq, struct ibv_send_wr *wr,
		     struct ibv_wc *out)
{
	struct ibv_send_wr *bad;
	struct ibv_wc wc;
	wr->send_flags |= IBV_SEND_SIGNALED;
	int r = ibv_post_send(qp, wr, &bad);
	if (r)
		return -r;
	if (poll1(cq, &wc, 5000))
		return -1000;
	if (out)
		*out = wc;
	return wc.status;
}

static const char *res(int r)
{
	static char b[64];
	if (r == -1000)
		return "timeout";
	if (r < 0) {
		snprintf(b, sizeof b, "post failed: %s", strerror(-r));
		return b;
	}
	return st(r);
}

/* Peer RDMA op on pair p against owner memory at addr with rkey. */
static int peer_rdma(struct pair *p, int write, uint64_t addr, uint32_t rkey,
		     uint32_t len)
{
	struct ibv_sge sge = { (uintptr_t)P.buf, len, P.mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1,
		.opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ };
	wr.wr.rdma.remote_addr = addr;
	wr.wr.rdma.rkey = rkey;
	return post_wait(p->qp_p, p->cq_p, &wr, NULL);
}

/* Bind a type-2 window by work request on the owner's QP. */
static int bind2(struct pair *p, struct ibv_mw *mw, uint32_t rkey, uint64_t addr,
		 uint64_t len, int signaled)
{
	struct ibv_send_wr wr = { .wr_id = 11, .opcode = IBV_WR_BIND_MW };
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info.mr = O.mr;
	wr.bind_mw.bind_info.addr = addr;
	wr.bind_mw.bind_info.length = len;
	wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
	uint32_t old = mw->rkey;
	int r;
	if (!signaled) {
		struct ibv_send_wr *bad;
		r = -ibv_post_send(p->qp_o, &wr, &bad);
	} else {
		r = post_wait(p->qp_o, p->cq_o, &wr, NULL);
	}
	/* librxe hands mw->rkey to the kernel as the window's current key and
	 * the kernel refuses a bind whose current key does not match: after a
	 * bind the application must record the new key in the ibv_mw. */
	mw->rkey = (r == 0 || !signaled) ? rkey : old;
	return r;
}

static int local_inv(struct pair *p, uint32_t rkey)
{
	struct ibv_send_wr wr = { .wr_id = 12, .opcode = IBV_WR_LOCAL_INV };
	wr.invalidate_rkey = rkey;
	return post_wait(p->qp_o, p->cq_o, &wr, NULL);
}

/* Peer sends a small message; with inv_rkey != 0, SEND_WITH_INV. Waits for
 * the owner's receive completion, which it returns in *wc. */
static int peer_send(struct pair *p, uint32_t inv_rkey, struct ibv_wc *wc)
{
	struct ibv_sge sge = { (uintptr_t)P.msg, MSG_SIZE, P.msg_mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 13, .sg_list = &sge, .num_sge = 1,
		.opcode = inv_rkey ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND };
	wr.invalidate_rkey = inv_rkey;
	int r = post_wait(p->qp_p, p->cq_p, &wr, NULL);
	if (r)
		return r;
	if (poll1(p->cq_o, wc, 5000))
		return -1000;
	return wc->status;
}

static int owner_send(struct pair *p, struct ibv_wc *peer_wc)
{
	struct ibv_sge sge = { (uintptr_t)O.msg, MSG_SIZE, O.msg_mr->lkey };
	struct ibv_send_wr wr = { .wr_id = 14, .sg_list = &sge, .num_sge = 1,
		.opcode = IBV_WR_SEND };
	int r = post_wait(p->qp_o, p->cq_o, &wr, NULL);
	if (r)
		return r;
	if (poll1(p->cq_p, peer_wc, 5000))
		return -1000;
	return peer_wc->status;
}

static int bad_access(int r)
{
	return r == IBV_WC_REM_ACCESS_ERR || r == IBV_WC_REM_INV_REQ_ERR ||
	       r == IBV_WC_REM_OP_ERR;
}

/* ------------------------------------------------------------------ */

static void device_info(void)
{
	struct ibv_device_attr da;
	if (ibv_query_device(O.ctx, &da))
		die("ibv_query_device");
	printf("INFO device=%s fw=%s max_mr=%d max_mw=%d max_qp=%d max_mr_size=%llu "
	       "page_size_cap=0x%llx device_cap_flags=0x%x\n",
	       devname, da.fw_ver, da.max_mr, da.max_mw, da.max_qp,
	       (unsigned long long)da.max_mr_size,
	       (unsigned long long)da.page_size_cap, da.device_cap_flags);
	printf("INFO cap MEM_WINDOW=%d MEM_WINDOW_TYPE_2A=%d MEM_WINDOW_TYPE_2B=%d "
	       "MEM_MGT_EXTENSIONS=%d\n",
	       !!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW),
	       !!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2A),
	       !!(da.device_cap_flags & IBV_DEVICE_MEM_WINDOW_TYPE_2B),
	       !!(da.device_cap_flags & IBV_DEVICE_MEM_MGT_EXTENSIONS));
	char g[64];
	for (int i = 0; i < 16; i++) {
		union ibv_gid gid;
		if (ibv_query_gid(O.ctx, 1, i, &gid))
			break;
		if (!gid.global.subnet_prefix && !gid.global.interface_id)
			continue;
		for (int j = 0; j < 16; j++)
			sprintf(g + 2 * j, "%02x", gid.raw[j]);
		printf("INFO gid[%d]=%s\n", i, g);
		if (gid_index < 0)
			gid_index = i;
	}
	printf("INFO using gid_index=%d\n", gid_index);
	fflush(stdout);
}

static void checks_type2(size_t slice_len)
{
	char name[80];
	struct pair p;
	uint64_t base = (uintptr_t)O.buf;
	uint64_t s0 = base + SLICE_OFF, s1 = s0 + slice_len;
	uint32_t L = 4096; /* access size */
	int r;

	errno = 0;
	struct ibv_mw *mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
	snprintf(name, sizeof name, "t2[%zuK] alloc_mw(TYPE_2)", slice_len >> 10);
	check(name, mw != NULL, "mw=%p errno=%d (%s) rkey=0x%x", (void *)mw, errno,
	      strerror(errno), mw ? mw->rkey : 0);
	if (!mw)
		return;
	uint32_t key = ibv_inc_rkey(mw->rkey);

	pair_up(&p);
	r = bind2(&p, mw, key, s0, slice_len, 1);
	snprintf(name, sizeof name, "t2[%zuK] IBV_WR_BIND_MW completion", slice_len >> 10);
	check(name, r == 0, "status=%s rkey=0x%x slice=[+%u MiB, +%zu KiB)", res(r), key,
	      SLICE_OFF >> 20, slice_len >> 10);
	if (r) {
		pair_down(&p);
		ibv_dealloc_mw(mw);
		return;
	}
	/* write inside, at both ends */
	memset(P.buf, 'W', L);
	r = peer_rdma(&p, 1, s0, key, L);
	int r2 = peer_rdma(&p, 1, s1 - L, key, L);
	int ok = !r && !r2 && O.buf[SLICE_OFF] == 'W' && O.buf[SLICE_OFF + slice_len - 1] == 'W';
	snprintf(name, sizeof name, "t2[%zuK] peer WRITE inside slice", slice_len >> 10);
	check(name, ok, "first=%s last=%s data=%s", res(r), res(r2), ok ? "landed" : "MISSING");
	/* read inside */
	memset(O.buf + SLICE_OFF, 'R', L);
	memset(P.buf, 0, L);
	r = peer_rdma(&p, 0, s0, key, L);
	ok = !r && P.buf[0] == 'R' && P.buf[L - 1] == 'R';
	snprintf(name, sizeof name, "t2[%zuK] peer READ inside slice", slice_len >> 10);
	check(name, ok, "status=%s data=%s", res(r), ok ? "read back" : "WRONG");
	/* dealloc the window before the QP it is bound to: the other order
	 * stalls ibv_destroy_qp (see the "QP destroyed" check) */
	ibv_dealloc_mw(mw);
	pair_down(&p);
}

/* Each negative check gets a fresh pair and a fresh window (an access error
 * takes both QPs to the error state). */
struct win { struct pair p; struct ibv_mw *mw; uint32_t key; uint64_t s0, s1; };

static int win_up(struct win *w, size_t slice_len)
{
	pair_up(&w->p);
	w->mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
	if (!w->mw)
		return -1;
	w->key = ibv_inc_rkey(w->mw->rkey);
	w->s0 = (uintptr_t)O.buf + SLICE_OFF;
	w->s1 = w->s0 + slice_len;
	return bind2(&w->p, w->mw, w->key, w->s0, slice_len, 1);
}

static void win_down(struct win *w)
{
	int r = ibv_dealloc_mw(w->mw);
	if (r)
		printf("INFO dealloc_mw -> %d (%s)\n", r, strerror(r));
	pair_down(&w->p);
}

static void negative_type2(void)
{
	const size_t SL = 64 << 10;
	struct win w;
	int r;
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qia;

	/* READ that starts inside and runs past the end */
	if (win_up(&w, SL)) { check("t2 setup", 0, "bind failed"); return; }
	r = peer_rdma(&w.p, 0, w.s1 - 2048, w.key, 4096);
	check("t2 peer READ crossing slice end", bad_access(r), "status=%s", res(r));
	win_down(&w);

	/* READ below the slice */
	win_up(&w, SL);
	r = peer_rdma(&w.p, 0, w.s0 - 4096, w.key, 4096);
	check("t2 peer READ below slice", bad_access(r), "status=%s", res(r));
	win_down(&w);

	/* WRITE above the slice: memory must be untouched */
	win_up(&w, SL);
	memset(O.buf + SLICE_OFF + SL, 'G', 4096);
	memset(P.buf, 'X', 4096);
	r = peer_rdma(&w.p, 1, w.s1, w.key, 4096);
	check("t2 peer WRITE above slice", bad_access(r) && O.buf[SLICE_OFF + SL] == 'G',
	      "status=%s memory=%s", res(r), O.buf[SLICE_OFF + SL] == 'G' ? "untouched" : "CHANGED");
	win_down(&w);

	/* WRITE far away (page 0 of guest RAM) */
	win_up(&w, SL);
	O.buf[0] = 'G';
	r = peer_rdma(&w.p, 1, (uintptr_t)O.buf, w.key, 4096);
	check("t2 peer WRITE elsewhere in guest RAM", bad_access(r) && O.buf[0] == 'G',
	      "status=%s memory=%s", res(r), O.buf[0] == 'G' ? "untouched" : "CHANGED");
	win_down(&w);

	/* The MR's own keys */
	win_up(&w, SL);
	r = peer_rdma(&w.p, 0, w.s0, O.mr->rkey, 4096);
	check("t2 peer READ with the MR's rkey", bad_access(r), "status=%s rkey=0x%x", res(r), O.mr->rkey);
	usleep(100000);
	ibv_query_qp(w.p.qp_o, &qa, IBV_QP_STATE, &qia);
	{
		int so = qa.qp_state;
		ibv_query_qp(w.p.qp_p, &qa, IBV_QP_STATE, &qia);
		printf("INFO after that remote access error: owner (responder) QP state=%d, peer (requester) QP state=%d (3=RTS 6=ERR)\n",
		       so, qa.qp_state);
	}
	win_down(&w);
	win_up(&w, SL);
	r = peer_rdma(&w.p, 0, w.s0, O.mr->lkey, 4096);
	check("t2 peer READ with the MR's lkey", bad_access(r), "status=%s lkey=0x%x", res(r), O.mr->lkey);
	win_down(&w);
	win_up(&w, SL);
	r = peer_rdma(&w.p, 1, w.s0, O.mr->rkey, 4096);
	check("t2 peer WRITE with the MR's rkey", bad_access(r), "status=%s", res(r));
	win_down(&w);

	/* Access rights of the window: a guest write's buffers need only REMOTE_READ,
	 * a guest read's only REMOTE_WRITE. */
	{
		pair_up(&w.p);
		w.mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
		w.s0 = (uintptr_t)O.buf + SLICE_OFF;
		w.key = ibv_inc_rkey(w.mw->rkey);
		struct ibv_send_wr wr = { .wr_id = 11, .opcode = IBV_WR_BIND_MW };
		wr.bind_mw.mw = w.mw;
		wr.bind_mw.rkey = w.key;
		wr.bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr, w.s0, SL, IBV_ACCESS_REMOTE_READ };
		r = post_wait(w.p.qp_o, w.p.cq_o, &wr, NULL);
		w.mw->rkey = w.key;
		int r2 = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
		O.buf[SLICE_OFF] = 'G';
		int r3 = peer_rdma(&w.p, 1, w.s0, w.key, 4096);
		check("t2 read-only window: READ ok, WRITE refused", r == 0 && r2 == 0 && bad_access(r3) &&
		      O.buf[SLICE_OFF] == 'G', "bind=%s read=%s write=%s memory=%s", res(r), res(r2), res(r3),
		      O.buf[SLICE_OFF] == 'G' ? "untouched" : "CHANGED");
		win_down(&w);
		pair_up(&w.p);
		w.mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
		w.key = ibv_inc_rkey(w.mw->rkey);
		wr.bind_mw.mw = w.mw;
		wr.bind_mw.rkey = w.key;
		wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_WRITE;
		r = post_wait(w.p.qp_o, w.p.cq_o, &wr, NULL);
		w.mw->rkey = w.key;
		r2 = peer_rdma(&w.p, 1, w.s0, w.key, 4096);
		r3 = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
		check("t2 write-only window: WRITE ok, READ refused", r == 0 && r2 == 0 && bad_access(r3),
		      "bind=%s write=%s read=%s", res(r), res(r2), res(r3));
		win_down(&w);
	}

	/* LOCAL_INV by the owner, then the old rkey */
	win_up(&w, SL);
	r = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
	int r2 = local_inv(&w.p, w.key);
	check("t2 owner LOCAL_INV completion", r == 0 && r2 == 0, "read-before=%s local_inv=%s",
	      res(r), res(r2));
	r = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
	check("t2 peer READ after LOCAL_INV (old rkey)", bad_access(r), "status=%s", res(r));
	win_down(&w);

	win_up(&w, SL);
	local_inv(&w.p, w.key);
	O.buf[SLICE_OFF] = 'G';
	r = peer_rdma(&w.p, 1, w.s0, w.key, 4096);
	check("t2 peer WRITE after LOCAL_INV (old rkey)", bad_access(r) && O.buf[SLICE_OFF] == 'G',
	      "status=%s memory=%s", res(r), O.buf[SLICE_OFF] == 'G' ? "untouched" : "CHANGED");
	win_down(&w);

	/* SEND_WITH_INV by the peer, then the old rkey */
	win_up(&w, SL);
	struct ibv_wc wc;
	r = peer_send(&w.p, w.key, &wc);
	check("t2 peer SEND_WITH_INV received", r == 0 && wc.invalidated_rkey == w.key,
	      "status=%s wc_flags=0x%x invalidated_rkey=0x%x (window 0x%x)",
	      res(r), wc.wc_flags, wc.invalidated_rkey, w.key);
	check("t2 recv wc has IBV_WC_WITH_INV (1<<3)", !!(wc.wc_flags & IBV_WC_WITH_INV),
	      "wc_flags=0x%x: GRH=%d bit2(IBV_WC_IP_CSUM_OK; kernel IB_WC_WITH_INVALIDATE)=%d bit3(IBV_WC_WITH_INV)=%d",
	      wc.wc_flags, !!(wc.wc_flags & 1), !!(wc.wc_flags & 4), !!(wc.wc_flags & 8));
	r = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
	check("t2 peer READ after SEND_WITH_INV (old rkey)", bad_access(r), "status=%s", res(r));
	win_down(&w);

	/* Rebind the same MW with the next key: old key dead, new key live */
	win_up(&w, SL);
	local_inv(&w.p, w.key);
	uint32_t k2 = ibv_inc_rkey(w.key);
	r = bind2(&w.p, w.mw, k2, w.s0 + SL, SL, 1);
	r2 = peer_rdma(&w.p, 0, w.s0 + SL, k2, 4096);
	check("t2 rebind same MW, new key works", r == 0 && r2 == 0, "bind=%s read=%s key 0x%x->0x%x",
	      res(r), res(r2), w.key, k2);
	r = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
	check("t2 old key after rebind", bad_access(r), "status=%s", res(r));
	win_down(&w);

	/* Rebind without invalidating first (must be refused for type 2) */
	win_up(&w, SL);
	r = bind2(&w.p, w.mw, ibv_inc_rkey(w.key), w.s0, SL, 1);
	check("t2 rebind while still bound (refused)", r != 0, "status=%s", res(r));
	win_down(&w);

	/* Type 2B: the window is tied to the QP it was bound on */
	win_up(&w, SL);
	struct pair q;
	pair_up(&q);
	r = peer_rdma(&q, 0, w.s0, w.key, 4096);
	check("t2 window used through another QP pair", bad_access(r),
	      "status=%s (window bound on QP %u, access arrives on QP %u)", res(r),
	      w.p.qp_o->qp_num, q.qp_o->qp_num);
	pair_down(&q);
	win_down(&w);

	/* LOCAL_INV from a different QP of the same PD */
	win_up(&w, SL);
	pair_up(&q);
	r = local_inv(&q, w.key);
	printf("INFO LOCAL_INV of a window from another QP of the PD: %s\n", res(r));
	r2 = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
	printf("INFO   then a peer READ on the binding QP: %s\n", res(r2));
	pair_down(&q);
	win_down(&w);

	/* Lost session: window bound, QP destroyed; is the window dead? can it be reused? */
	win_up(&w, SL);
	uint32_t oldkey = w.key;
	printf("INFO window 0x%x bound on owner QP %u; destroying that QP pair\n", oldkey, w.p.qp_o->qp_num);
	double td = now_us();
	ibv_destroy_qp(w.p.qp_o);
	printf("INFO   ibv_destroy_qp took %.0f ms\n", (now_us() - td) / 1000);
	ibv_destroy_qp(w.p.qp_p);
	ibv_destroy_cq(w.p.cq_o);
	ibv_destroy_cq(w.p.cq_p);
	pair_up(&w.p);
	r = peer_rdma(&w.p, 0, w.s0, oldkey, 4096);
	check("t2 old key after its QP was destroyed", bad_access(r),
	      "status=%s (new owner QP %u)", res(r), w.p.qp_o->qp_num);
	pair_down(&w.p);
	pair_up(&w.p);
	r = bind2(&w.p, w.mw, ibv_inc_rkey(oldkey), w.s0, SL, 1);
	printf("INFO rebind of that window on a new QP without invalidating: %s\n", res(r));
	r = ibv_dealloc_mw(w.mw);
	check("t2 dealloc_mw of a window whose QP died", r == 0, "ret=%d", r);
	pair_down(&w.p);

	/* Dealloc while bound, on a live QP; then the key */
	win_up(&w, SL);
	r = ibv_dealloc_mw(w.mw);
	r2 = peer_rdma(&w.p, 0, w.s0, w.key, 4096);
	check("t2 dealloc_mw while bound kills the key", r == 0 && bad_access(r2),
	      "dealloc=%d read=%s", r, res(r2));
	pair_down(&w.p);

	/* MR without MW_BIND cannot be a bind target */
	{
		struct ibv_mr *plain = ibv_reg_mr(O.pd, O.buf + (8 << 20), 1 << 20,
						  IBV_ACCESS_LOCAL_WRITE);
		pair_up(&w.p);
		w.mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
		struct ibv_send_wr wr = { .wr_id = 11, .opcode = IBV_WR_BIND_MW };
		wr.bind_mw.mw = w.mw;
		wr.bind_mw.rkey = ibv_inc_rkey(w.mw->rkey);
		wr.bind_mw.bind_info.mr = plain;
		wr.bind_mw.bind_info.addr = (uintptr_t)plain->addr;
		wr.bind_mw.bind_info.length = 4096;
		wr.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
		r = post_wait(w.p.qp_o, w.p.cq_o, &wr, NULL);
		check("t2 bind to an MR without MW_BIND (refused)", r != 0, "status=%s", res(r));
		ibv_dealloc_mw(w.mw);
		pair_down(&w.p);
		ibv_dereg_mr(plain);
	}
}

static void checks_type1(void)
{
	const size_t SL = 64 << 10;
	struct pair p;
	int r;
	errno = 0;
	struct ibv_mw *mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_1);
	check("t1 alloc_mw(TYPE_1)", mw != NULL, "errno=%d (%s)", errno, strerror(errno));
	if (!mw)
		return;
	uint64_t s0 = (uintptr_t)O.buf + SLICE_OFF;
	pair_up(&p);
	struct ibv_mw_bind b = { .wr_id = 21, .send_flags = IBV_SEND_SIGNALED,
		.bind_info = { .mr = O.mr, .addr = s0, .length = SL,
			       .mw_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE } };
	r = ibv_bind_mw(p.qp_o, mw, &b);
	struct ibv_wc wc = {0};
	int pr = r ? -1 : poll1(p.cq_o, &wc, 5000);
	check("t1 ibv_bind_mw", r == 0 && pr == 0 && wc.status == 0, "ret=%d completion=%s rkey=0x%x",
	      r, pr ? "none" : st(wc.status), mw->rkey);
	uint32_t key = mw->rkey;
	r = peer_rdma(&p, 0, s0, key, 4096);
	check("t1 peer READ inside", r == 0, "status=%s", res(r));
	/* unbind: bind with length 0 */
	struct ibv_mw_bind u = { .wr_id = 22, .send_flags = IBV_SEND_SIGNALED,
		.bind_info = { .mr = O.mr, .addr = 0, .length = 0 } };
	if (getenv("MWTEST_NULL_MR_UNBIND")) {
		u.bind_info.mr = NULL; /* as ibv_bind_mw(3) allows: crashes in librxe 44 */
		printf("INFO t1 unbind with bind_info.mr=NULL ...\n");
		fflush(stdout);
	}
	r = ibv_bind_mw(p.qp_o, mw, &u);
	pr = r ? -1 : poll1(p.cq_o, &wc, 5000);
	check("t1 unbind (bind length 0)", r == 0 && pr == 0 && wc.status == 0,
	      "ret=%d completion=%s new rkey=0x%x", r, pr ? "none" : st(wc.status), mw->rkey);
	r = peer_rdma(&p, 0, s0, key, 4096);
	check("t1 peer READ with old key after unbind", bad_access(r), "status=%s", res(r));
	pair_down(&p);
	/* outside */
	pair_up(&p);
	b.bind_info.length = SL;
	r = ibv_bind_mw(p.qp_o, mw, &b);
	poll1(p.cq_o, &wc, 5000);
	r = peer_rdma(&p, 0, s0 + SL, mw->rkey, 4096);
	check("t1 peer READ outside", bad_access(r), "status=%s", res(r));
	pair_down(&p);
	/* type 1 is not tied to a QP: use the key on another QP */
	pair_up(&p);
	struct pair q;
	pair_up(&q);
	b.bind_info.length = SL;
	r = ibv_bind_mw(p.qp_o, mw, &b);
	poll1(p.cq_o, &wc, 5000);
	r = peer_rdma(&q, 0, s0, mw->rkey, 4096);
	printf("INFO t1 window bound on one QP, used on another QP of the PD: %s\n", res(r));
	pair_down(&q);
	pair_down(&p);
	ibv_dealloc_mw(mw);
}

static void checks_mr(void)
{
	const size_t SL = 64 << 10;
	struct pair p;
	int r;
	pair_up(&p);
	struct ibv_mr *mr = ibv_reg_mr(O.pd, O.buf + SLICE_OFF, SL,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
				       IBV_ACCESS_REMOTE_WRITE);
	check("mr per-request ibv_reg_mr of the slice", mr != NULL, "errno=%d", errno);
	r = peer_rdma(&p, 0, (uintptr_t)O.buf + SLICE_OFF, mr->rkey, 4096);
	check("mr peer READ inside", r == 0, "status=%s", res(r));
	uint32_t key = mr->rkey;
	ibv_dereg_mr(mr);
	r = peer_rdma(&p, 0, (uintptr_t)O.buf + SLICE_OFF, key, 4096);
	check("mr peer READ after dereg", bad_access(r), "status=%s", res(r));
	pair_down(&p);
	pair_up(&p);
	mr = ibv_reg_mr(O.pd, O.buf + SLICE_OFF, SL, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	r = peer_rdma(&p, 0, (uintptr_t)O.buf + SLICE_OFF + SL, mr->rkey, 4096);
	check("mr peer READ outside", bad_access(r), "status=%s", res(r));
	ibv_dereg_mr(mr);
	pair_down(&p);
}

/* ------------------------------------------------------------------ */

static void bench_line(const char *name, int n, double t0, double t1)
{
	printf("BENCH %-52s iters=%-6d us_per=%.2f\n", name, n, (t1 - t0) / n);
	fflush(stdout);
}

static void benches(void)
{
	size_t sizes[] = { 4 << 10, 64 << 10, 1 << 20 };
	struct pair p;
	struct ibv_wc wc;
	char name[96];
	int N = iters;

	pair_up(&p);
	struct ibv_mw *mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
	uint32_t key = mw->rkey;
	uint64_t s0 = (uintptr_t)O.buf + SLICE_OFF;

	for (int si = 0; si < 3; si++) {
		size_t len = sizes[si];
		/* bind + LOCAL_INV, each signaled and waited */
		double t0 = now_us();
		for (int i = 0; i < N; i++) {
			key = ibv_inc_rkey(key);
			if (bind2(&p, mw, key, s0, len, 1) || local_inv(&p, key)) {
				printf("FATAL bench bind/inv failed at %d\n", i);
				exit(2);
			}
		}
		snprintf(name, sizeof name, "t2 bind+local_inv waited each [%zuK]", len >> 10);
		bench_line(name, N, t0, now_us());

		/* bind (unsignaled) + LOCAL_INV (signaled) in one post */
		t0 = now_us();
		for (int i = 0; i < N; i++) {
			key = ibv_inc_rkey(key);
			struct ibv_send_wr inv = { .wr_id = 12, .opcode = IBV_WR_LOCAL_INV,
						   .send_flags = IBV_SEND_SIGNALED };
			inv.invalidate_rkey = key;
			struct ibv_send_wr b = { .wr_id = 11, .opcode = IBV_WR_BIND_MW, .next = &inv };
			b.bind_mw.mw = mw;
			b.bind_mw.rkey = key;
			b.bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr, s0, len,
				IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
			struct ibv_send_wr *bad;
			int pr = ibv_post_send(p.qp_o, &b, &bad);
			mw->rkey = key;
			if (pr || poll1(p.cq_o, &wc, 5000) || wc.status) {
				printf("FATAL bench chained failed at %d\n", i);
				exit(2);
			}
		}
		snprintf(name, sizeof name, "t2 bind+local_inv chained, 1 post [%zuK]", len >> 10);
		bench_line(name, N, t0, now_us());

		/* per-request MR */
		int M = len >= (1 << 20) ? N / 10 : N;
		t0 = now_us();
		for (int i = 0; i < M; i++) {
			struct ibv_mr *mr = ibv_reg_mr(O.pd, O.buf + SLICE_OFF, len,
						       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
						       IBV_ACCESS_REMOTE_WRITE);
			if (!mr || ibv_dereg_mr(mr))
				die("bench reg_mr");
		}
		snprintf(name, sizeof name, "mr ibv_reg_mr+ibv_dereg_mr [%zuK]", len >> 10);
		bench_line(name, M, t0, now_us());
	}
	ibv_dealloc_mw(mw);

	/* alloc+dealloc of a window (if one per request rather than a pool) */
	double t0 = now_us();
	for (int i = 0; i < N; i++) {
		struct ibv_mw *m = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
		if (!m || ibv_dealloc_mw(m))
			die("bench alloc_mw");
	}
	bench_line("t2 ibv_alloc_mw+ibv_dealloc_mw", N, t0, now_us());

	/* type 1 bind + unbind */
	struct ibv_mw *m1 = ibv_alloc_mw(O.pd, IBV_MW_TYPE_1);
	if (m1) {
		t0 = now_us();
		for (int i = 0; i < N; i++) {
			struct ibv_mw_bind b = { .wr_id = 21, .send_flags = IBV_SEND_SIGNALED,
				.bind_info = { O.mr, s0, 64 << 10,
					       IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE } };
			struct ibv_mw_bind u = { .wr_id = 22, .send_flags = IBV_SEND_SIGNALED,
				.bind_info = { .mr = O.mr } };
			if (ibv_bind_mw(p.qp_o, m1, &b) || poll1(p.cq_o, &wc, 5000) || wc.status ||
			    ibv_bind_mw(p.qp_o, m1, &u) || poll1(p.cq_o, &wc, 5000) || wc.status) {
				printf("FATAL bench t1 at %d status=%s\n", i, st(wc.status));
				break;
			}
		}
		bench_line("t1 ibv_bind_mw+unbind waited each [64K]", N, t0, now_us());
		ibv_dealloc_mw(m1);
	}
	pair_down(&p);

	/* A request with 16 scattered 4 KiB segments: 16 windows bound and
	 * invalidated (one post each way), or 16 MRs registered and deregistered. */
	{
		enum { K = 16 };
		struct ibv_mw *ws[K];
		pair_up(&p);
		for (int k = 0; k < K; k++)
			ws[k] = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
		double t0 = now_us();
		for (int i = 0; i < N / 4; i++) {
			struct ibv_send_wr b[K], inv[K], *bad;
			for (int k = 0; k < K; k++) {
				uint32_t nk = ibv_inc_rkey(ws[k]->rkey);
				b[k] = (struct ibv_send_wr){ .wr_id = 11, .opcode = IBV_WR_BIND_MW,
					.next = k + 1 < K ? &b[k + 1] : NULL };
				b[k].bind_mw.mw = ws[k];
				b[k].bind_mw.rkey = nk;
				b[k].bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr,
					s0 + (uint64_t)k * 65536, 4096,
					IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
				inv[k] = (struct ibv_send_wr){ .wr_id = 12, .opcode = IBV_WR_LOCAL_INV,
					.next = k + 1 < K ? &inv[k + 1] : NULL,
					.send_flags = k + 1 == K ? IBV_SEND_SIGNALED : 0 };
				inv[k].invalidate_rkey = nk;
			}
			if (ibv_post_send(p.qp_o, b, &bad))
				die("bind x16");
			for (int k = 0; k < K; k++)
				ws[k]->rkey = b[k].bind_mw.rkey;
			if (ibv_post_send(p.qp_o, inv, &bad) || poll1(p.cq_o, &wc, 5000) || wc.status) {
				printf("FATAL x16 %s\n", st(wc.status));
				exit(2);
			}
		}
		bench_line("t2 16 segments: 16 binds + 16 local_inv [4K each]", N / 4, t0, now_us());
		for (int k = 0; k < K; k++)
			ibv_dealloc_mw(ws[k]);
		t0 = now_us();
		for (int i = 0; i < N / 4; i++) {
			struct ibv_mr *mrs[K];
			for (int k = 0; k < K; k++)
				mrs[k] = ibv_reg_mr(O.pd, O.buf + SLICE_OFF + (size_t)k * 65536, 4096,
						    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
						    IBV_ACCESS_REMOTE_WRITE);
			for (int k = 0; k < K; k++)
				if (!mrs[k] || ibv_dereg_mr(mrs[k]))
					die("reg x16");
		}
		bench_line("mr 16 segments: 16 reg_mr + 16 dereg_mr [4K each]", N / 4, t0, now_us());
		pair_down(&p);
	}

	/* A whole request round trip, as devlend does it: the borrower SENDs a
	 * request, the lender RDMA-WRITEs len bytes (a read's data) into the
	 * slice and SENDs the response; the borrower takes the response. */
	size_t rsz[] = { 4 << 10, 64 << 10 };
	const char *modes[] = { "none (whole-RAM MR rkey)", "t2 bind+SEND, lender SEND_WITH_INV",
				"t2 bind+SEND, owner LOCAL_INV", "mr reg_mr+SEND, dereg_mr" };
	/* for the "none" mode, a whole-buffer MR with remote access, as today */
	struct ibv_mr *whole = ibv_reg_mr(O.pd, O.buf, BUF_SIZE, IBV_ACCESS_LOCAL_WRITE |
					  IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
					  IBV_ACCESS_MW_BIND);
	if (!whole)
		die("whole MR");
	for (int zi = 0; zi < 2; zi++) {
		size_t len = rsz[zi];
		for (int m = 0; m < 4; m++) {
			pair_up(&p);
			mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
			key = mw->rkey;
			int n = N, reposted = 0;
			double t0 = now_us();
			for (int i = 0; i < n; i++) {
				uint32_t rkey = whole->rkey;
				struct ibv_mr *mr = NULL;
				struct ibv_sge osge = { (uintptr_t)O.msg, MSG_SIZE, O.msg_mr->lkey };
				struct ibv_send_wr send = { .wr_id = 14, .sg_list = &osge, .num_sge = 1,
					.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
				struct ibv_send_wr b = { .wr_id = 11, .opcode = IBV_WR_BIND_MW, .next = &send };
				struct ibv_send_wr *first = &send, *bad;
				if (m == 1 || m == 2) {
					key = ibv_inc_rkey(key);
					rkey = key;
					b.bind_mw.mw = mw;
					b.bind_mw.rkey = key;
					b.bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr, s0, len,
						IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
					first = &b;
				} else if (m == 3) {
					mr = ibv_reg_mr(O.pd, O.buf + SLICE_OFF, len, IBV_ACCESS_LOCAL_WRITE |
							IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
					rkey = mr->rkey;
				}
				if (ibv_post_send(p.qp_o, first, &bad))
					die("req post");
				if (m == 1 || m == 2)
					mw->rkey = key;
				/* lender: receive the request, WRITE the data, send the response */
				if (poll1(p.cq_p, &wc, 5000) || wc.status) {
					printf("FATAL req recv %s\n", st(wc.status));
					exit(2);
				}
				struct ibv_sge psge = { (uintptr_t)P.buf, len, P.mr->lkey };
				struct ibv_sge rsge = { (uintptr_t)P.msg, MSG_SIZE, P.msg_mr->lkey };
				struct ibv_send_wr resp = { .wr_id = 13, .sg_list = &rsge, .num_sge = 1,
					.opcode = m == 1 ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND,
					.send_flags = IBV_SEND_SIGNALED };
				resp.invalidate_rkey = m == 1 ? rkey : 0;
				struct ibv_send_wr wdata = { .wr_id = 15, .sg_list = &psge, .num_sge = 1,
					.opcode = IBV_WR_RDMA_WRITE, .next = &resp };
				wdata.wr.rdma.remote_addr = s0;
				wdata.wr.rdma.rkey = rkey;
				if (ibv_post_send(p.qp_p, &wdata, &bad))
					die("resp post");
				/* borrower: its SEND completion and the response */
				int got_send = 0, got_resp = 0;
				while (!got_send || !got_resp) {
					if (poll1(p.cq_o, &wc, 5000) || wc.status) {
						printf("FATAL owner wc %s\n", st(wc.status));
						exit(2);
					}
					if (wc.opcode == IBV_WC_RECV)
						got_resp = 1;
					else
						got_send = 1;
				}
				if (poll1(p.cq_p, &wc, 5000) || wc.status) {
					printf("FATAL lender send wc %s\n", st(wc.status));
					exit(2);
				}
				if (m == 2 && local_inv(&p, rkey))
					die("local_inv");
				if (m == 3)
					ibv_dereg_mr(mr);
				if (++reposted == 150) {
					post_recv(&O, p.qp_o, 150);
					post_recv(&P, p.qp_p, 150);
					reposted = 0;
				}
			}
			snprintf(name, sizeof name, "req %s [%zuK]", modes[m], len >> 10);
			bench_line(name, n, t0, now_us());
			ibv_dealloc_mw(mw);
			pair_down(&p);
		}
	}
	ibv_dereg_mr(whole);
}


/* ------------------------------------------------------------------ */
/* Interleaved benchmarks: every iteration runs each variant once, so the
 * noise of an emulated CPU shared with other work hits all alike; reports
 * median, mean and p90 per variant. */

static int cmpd(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void report(const char *name, double *v, int n)
{
	double sum = 0;
	for (int i = 0; i < n; i++)
		sum += v[i];
	qsort(v, n, sizeof *v, cmpd);
	printf("IBENCH %-56s n=%-6d median_us=%8.2f mean_us=%8.2f p90_us=%8.2f\n", name, n,
	       v[n / 2], sum / n, v[(int)(n * 0.9)]);
	fflush(stdout);
}

/* One request round trip (see benches()): mode 0 none, 1 window + lender
 * SEND_WITH_INV, 2 window + borrower LOCAL_INV (waited), 3 per-request MR. */
static double one_request(struct pair *p, int m, size_t len, struct ibv_mw *mw,
			  struct ibv_mr *whole, int *reposted)
{
	struct ibv_wc wc;
	uint64_t s0 = (uintptr_t)O.buf + SLICE_OFF;
	double t0 = now_us();
	uint32_t rkey = whole->rkey, key = 0;
	struct ibv_mr *mr = NULL;
	struct ibv_sge osge = { (uintptr_t)O.msg, MSG_SIZE, O.msg_mr->lkey };
	struct ibv_send_wr send = { .wr_id = 14, .sg_list = &osge, .num_sge = 1,
		.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr b = { .wr_id = 11, .opcode = IBV_WR_BIND_MW, .next = &send };
	struct ibv_send_wr *first = &send, *bad;
	if (m == 1 || m == 2) {
		key = ibv_inc_rkey(mw->rkey);
		rkey = key;
		b.bind_mw.mw = mw;
		b.bind_mw.rkey = key;
		b.bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr, s0, len,
			IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
		first = &b;
	} else if (m == 3) {
		mr = ibv_reg_mr(O.pd, O.buf + SLICE_OFF, len, IBV_ACCESS_LOCAL_WRITE |
				IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
		rkey = mr->rkey;
	}
	if (ibv_post_send(p->qp_o, first, &bad))
		die("req post");
	if (key)
		mw->rkey = key;
	if (poll1(p->cq_p, &wc, 5000) || wc.status) {
		printf("FATAL req recv %s\n", st(wc.status));
		exit(2);
	}
	struct ibv_sge psge = { (uintptr_t)P.buf, len, P.mr->lkey };
	struct ibv_sge rsge = { (uintptr_t)P.msg, MSG_SIZE, P.msg_mr->lkey };
	struct ibv_send_wr resp = { .wr_id = 13, .sg_list = &rsge, .num_sge = 1,
		.opcode = m == 1 ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND,
		.send_flags = IBV_SEND_SIGNALED };
	resp.invalidate_rkey = m == 1 ? rkey : 0;
	struct ibv_send_wr wdata = { .wr_id = 15, .sg_list = &psge, .num_sge = 1,
		.opcode = IBV_WR_RDMA_WRITE, .next = &resp };
	wdata.wr.rdma.remote_addr = s0;
	wdata.wr.rdma.rkey = rkey;
	if (ibv_post_send(p->qp_p, &wdata, &bad))
		die("resp post");
	int got_send = 0, got_resp = 0;
	while (!got_send || !got_resp) {
		if (poll1(p->cq_o, &wc, 5000) || wc.status) {
			printf("FATAL owner wc %s\n", st(wc.status));
			exit(2);
		}
		if (wc.opcode == IBV_WC_RECV) {
			got_resp = 1;
			if (m == 1 && wc.invalidated_rkey != rkey) {
				printf("FATAL response did not invalidate 0x%x\n", rkey);
				exit(2);
			}
		} else {
			got_send = 1;
		}
	}
	if (poll1(p->cq_p, &wc, 5000) || wc.status) {
		printf("FATAL lender send wc %s\n", st(wc.status));
		exit(2);
	}
	if (m == 2 && local_inv(p, rkey))
		die("local_inv");
	if (m == 3)
		ibv_dereg_mr(mr);
	double dt = now_us() - t0;
	if (++*reposted == 150) {
		post_recv(&O, p->qp_o, 150);
		post_recv(&P, p->qp_p, 150);
		*reposted = 0;
	}
	return dt;
}

static void ibenches(void)
{
	int N = iters;
	struct pair p;
	struct ibv_wc wc;
	enum { V = 8, K = 16 };
	const char *names[V] = {
		"t2 bind+local_inv, chained in 1 post [4K]",
		"t2 bind+local_inv, chained in 1 post [1M]",
		"t2 bind waited, then local_inv waited [4K]",
		"mr ibv_reg_mr+ibv_dereg_mr [4K]",
		"mr ibv_reg_mr+ibv_dereg_mr [1M]",
		"t1 ibv_bind_mw+unbind, each waited [4K]",
		"t2 16 segments: 16 binds+16 local_inv, 2 posts",
		"mr 16 segments: 16 reg_mr+16 dereg_mr",
	};
	double *v[V];
	for (int k = 0; k < V; k++)
		v[k] = calloc(N, sizeof(double));
	pair_up(&p);
	struct ibv_mw *mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
	struct ibv_mw *m1 = ibv_alloc_mw(O.pd, IBV_MW_TYPE_1);
	struct ibv_mw *ws[K];
	for (int k = 0; k < K; k++)
		ws[k] = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
	uint64_t s0 = (uintptr_t)O.buf + SLICE_OFF;
	const int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
	for (int i = 0; i < N; i++) {
		/* rotate the order each iteration: no variant always runs first */
		for (int kk = 0; kk < V; kk++) {
			int k = (kk + i) % V;
			double t0 = now_us();
			if (k <= 1) {
				uint32_t key = ibv_inc_rkey(mw->rkey);
				struct ibv_send_wr inv = { .wr_id = 12, .opcode = IBV_WR_LOCAL_INV,
							   .send_flags = IBV_SEND_SIGNALED };
				inv.invalidate_rkey = key;
				struct ibv_send_wr b = { .wr_id = 11, .opcode = IBV_WR_BIND_MW, .next = &inv }, *bad;
				b.bind_mw.mw = mw;
				b.bind_mw.rkey = key;
				b.bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr, s0,
					k == 0 ? 4096 : 1 << 20, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
				int r = ibv_post_send(p.qp_o, &b, &bad);
				mw->rkey = key;
				if (r || poll1(p.cq_o, &wc, 5000) || wc.status)
					die("ibench bind chained");
			} else if (k == 2) {
				uint32_t key = ibv_inc_rkey(mw->rkey);
				if (bind2(&p, mw, key, s0, 4096, 1) || local_inv(&p, key))
					die("ibench bind waited");
			} else if (k == 3 || k == 4) {
				struct ibv_mr *mr = ibv_reg_mr(O.pd, O.buf + SLICE_OFF, k == 3 ? 4096 : 1 << 20, acc);
				if (!mr || ibv_dereg_mr(mr))
					die("ibench reg");
			} else if (k == 5) {
				struct ibv_mw_bind b = { .wr_id = 21, .send_flags = IBV_SEND_SIGNALED,
					.bind_info = { O.mr, s0, 4096, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE } };
				struct ibv_mw_bind u = { .wr_id = 22, .send_flags = IBV_SEND_SIGNALED,
					.bind_info = { .mr = O.mr } };
				if (ibv_bind_mw(p.qp_o, m1, &b) || poll1(p.cq_o, &wc, 5000) || wc.status ||
				    ibv_bind_mw(p.qp_o, m1, &u) || poll1(p.cq_o, &wc, 5000) || wc.status)
					die("ibench t1");
			} else if (k == 6) {
				struct ibv_send_wr b[K], inv[K], *bad;
				for (int j = 0; j < K; j++) {
					uint32_t nk = ibv_inc_rkey(ws[j]->rkey);
					b[j] = (struct ibv_send_wr){ .wr_id = 11, .opcode = IBV_WR_BIND_MW,
						.next = j + 1 < K ? &b[j + 1] : NULL };
					b[j].bind_mw.mw = ws[j];
					b[j].bind_mw.rkey = nk;
					b[j].bind_mw.bind_info = (struct ibv_mw_bind_info){ O.mr,
						s0 + (uint64_t)j * 65536, 4096,
						IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE };
					inv[j] = (struct ibv_send_wr){ .wr_id = 12, .opcode = IBV_WR_LOCAL_INV,
						.next = j + 1 < K ? &inv[j + 1] : NULL,
						.send_flags = j + 1 == K ? IBV_SEND_SIGNALED : 0 };
					inv[j].invalidate_rkey = nk;
				}
				if (ibv_post_send(p.qp_o, b, &bad))
					die("ibench x16 bind");
				for (int j = 0; j < K; j++)
					ws[j]->rkey = b[j].bind_mw.rkey;
				if (ibv_post_send(p.qp_o, inv, &bad) || poll1(p.cq_o, &wc, 5000) || wc.status)
					die("ibench x16 inv");
			} else {
				struct ibv_mr *mrs[K];
				for (int j = 0; j < K; j++)
					mrs[j] = ibv_reg_mr(O.pd, O.buf + SLICE_OFF + (size_t)j * 65536, 4096, acc);
				for (int j = 0; j < K; j++)
					if (!mrs[j] || ibv_dereg_mr(mrs[j]))
						die("ibench x16 reg");
			}
			v[k][i] = now_us() - t0;
		}
	}
	for (int k = 0; k < V; k++)
		report(names[k], v[k], N);
	for (int k = 0; k < K; k++)
		ibv_dealloc_mw(ws[k]);
	ibv_dealloc_mw(m1);
	ibv_dealloc_mw(mw);
	pair_down(&p);

	/* request round trips, interleaved by mode */
	const char *modes[4] = { "none (whole-RAM MR rkey, as today)",
		"t2 bind+SEND, lender SEND_WITH_INV", "t2 bind+SEND, borrower LOCAL_INV waited",
		"mr reg_mr+SEND, dereg_mr" };
	struct ibv_mr *whole = ibv_reg_mr(O.pd, O.buf, BUF_SIZE, acc | IBV_ACCESS_MW_BIND);
	size_t lens[2] = { 4096, 65536 };
	for (int li = 0; li < 2; li++) {
		int n = li == 0 ? N : N / 5;
		double *rv[4];
		for (int m = 0; m < 4; m++)
			rv[m] = calloc(n, sizeof(double));
		pair_up(&p);
		mw = ibv_alloc_mw(O.pd, IBV_MW_TYPE_2);
		int reposted = 0;
		for (int i = 0; i < n; i++)
			for (int mm = 0; mm < 4; mm++) {
				int m = (mm + i) % 4;
				rv[m][i] = one_request(&p, m, lens[li], mw, whole, &reposted);
			}
		for (int m = 0; m < 4; m++) {
			char name[96];
			snprintf(name, sizeof name, "req %s [%zuK]", modes[m], lens[li] >> 10);
			report(name, rv[m], n);
			free(rv[m]);
		}
		ibv_dealloc_mw(mw);
		pair_down(&p);
	}
	ibv_dereg_mr(whole);
	for (int k = 0; k < V; k++)
		free(v[k]);
}

int main(int argc, char **argv)
{
	int opt, only_checks = 0;
	setvbuf(stdout, NULL, _IOLBF, 0);
	while ((opt = getopt(argc, argv, "d:g:n:cr:I")) != -1) {
		switch (opt) {
		case 'd': devname = optarg; break;
		case 'g': gid_index = atoi(optarg); break;
		case 'n': iters = atoi(optarg); break;
		case 'c': only_checks = 1; break;
		case 'r': reps = atoi(optarg); break;
		case 'I': interleaved = 1; break;
		default:
			fprintf(stderr, "usage: %s [-d dev] [-g gid] [-n iters] [-c]\n", argv[0]);
			return 2;
		}
	}
	/* gid index is resolved by device_info on a first context */
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0]) {
		printf("FATAL no RDMA device\n");
		return 2;
	}
	ibv_free_device_list(list);
	{
		int want = gid_index;
		gid_index = want < 0 ? 0 : want;
		open_side(&O, BUF_SIZE, 1);
		gid_index = want;
		device_info();
		if (ibv_query_gid(O.ctx, 1, gid_index, &O.gid))
			die("ibv_query_gid");
		open_side(&P, PEER_BUF, 0);
	}
	printf("INFO owner MR: 16 MiB at %p lkey=0x%x rkey=0x%x access=LOCAL_WRITE|MW_BIND\n",
	       (void *)O.buf, O.mr->lkey, O.mr->rkey);

	checks_type2(4 << 10);
	checks_type2(64 << 10);
	checks_type2(1 << 20);
	negative_type2();
	checks_type1();
	checks_mr();
	printf("SUMMARY checks_failed=%d\n", fails);
	if (interleaved && !only_checks)
		ibenches();
	else if (!only_checks)
		for (int k = 0; k < reps; k++) {
			printf("INFO bench pass %d of %d\n", k + 1, reps);
			benches();
		}
	printf("DONE\n");
	return fails ? 1 : 0;
}
