//! Coherence mode `mirror`: the DMA-mapped guest pages pushed to the lender's mirror
//! before a BAR write, and the mirror pages pulled into guest memory after an interrupt;
//! of a page that changed, only the bytes that changed move (`changed_runs`).

use std::io;
use std::sync::atomic::Ordering;

use devlend_fabric::pci::{
    changed_runs, decode_pages, decode_ranges, encode_page, encode_range, page_cost, Message,
    Range, FLAG_MORE, KIND_PULL, KIND_PUSH, MAX_ACCESS, MIRROR_PAGE, RDMA_MAX_RANGES,
};
use vm_memory::VolatileSlice;

use super::dma::{shrunk, GuestMap, MapSync};
use super::link::PageMoves;
use super::{link_err, Borrowed, LinkError, PciBorrower};

impl PciBorrower {
    /// Pushes the DMA-mapped guest pages that changed since last synced: over TCP with
    /// their bytes, over RDMA as IOVA ranges the lender reads one-sided.
    pub(super) fn push(&self, maps: &mut [GuestMap]) -> io::Result<()> {
        let ranges = self.shared.link.page_moves() == PageMoves::Ranges;
        let page = MIRROR_PAGE as usize;
        let mut buf = vec![0u8; page];
        // A changed page's runs of changed bytes, reused from page to page.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        let mut chunk = Vec::new();
        let mut pushed = 0u64;
        // Over RDMA: the run of changed pages being built (IOVA, bytes).
        let mut run: Option<(u64, u32)> = None;
        for m in maps.iter_mut() {
            if !m.intact() {
                return Err(shrunk(m));
            }
            // SAFETY: `ptr..ptr + size` is the map's live mapping while `m` lives; built
            // from the raw parts so that the shadow may be borrowed beside it.
            let slice = unsafe { VolatileSlice::new(m.ptr.as_ptr(), m.size) };
            for off in (0..m.size).step_by(page) {
                let Ok(s) = slice.subslice(off, page) else {
                    break;
                };
                // A mediated map has no mirror to push to.
                let MapSync::Mirror { shadow } = &mut m.sync else {
                    break;
                };
                let Some(shadow) = shadow.get_mut(off..off + page) else {
                    break;
                };
                s.copy_to(&mut buf[..]);
                if shadow == buf.as_slice() {
                    continue;
                }
                pushed += 1;
                // Only the bytes the guest changed: the function may have written
                // others of the page since the last pull, which a whole page would undo.
                runs.clear();
                changed_runs(shadow, &buf, |o, n| runs.push((o, n)));
                shadow.copy_from_slice(&buf);
                for &(o, n) in &runs {
                    let iova = m.iova + (off + o) as u64;
                    if ranges {
                        run = match run {
                            Some((start, len))
                                if start + u64::from(len) == iova
                                    && len as usize + n <= RDMA_MAX_RUN =>
                            {
                                Some((start, len + n as u32))
                            }
                            Some((start, len)) => {
                                self.push_range(&mut chunk, Range { iova: start, len })?;
                                Some((iova, n as u32))
                            }
                            None => Some((iova, n as u32)),
                        };
                        continue;
                    }
                    if chunk.len() + page_cost(n) > MAX_ACCESS as usize {
                        let mut msg = Message::new(KIND_PUSH, std::mem::take(&mut chunk));
                        msg.flags = FLAG_MORE;
                        self.shared.link.send(&msg).map_err(link_err)?;
                    }
                    encode_page(iova, &buf[o..o + n], &mut chunk);
                }
            }
            // Runs do not cross maps (each has its own registration).
            if let Some((start, len)) = run.take() {
                self.push_range(&mut chunk, Range { iova: start, len })?;
            }
        }
        if pushed == 0 {
            return Ok(());
        }
        self.shared
            .stats
            .pages_pushed
            .fetch_add(pushed, Ordering::Relaxed);
        self.shared
            .link
            .call(Message::new(KIND_PUSH, chunk))
            .map(|_| ())
            .map_err(link_err)
    }

    /// Adds a range to an RDMA push, sending the chunk first when it is full.
    fn push_range(&self, chunk: &mut Vec<u8>, r: Range) -> io::Result<()> {
        if chunk.len() / 16 >= RDMA_MAX_RANGES {
            let mut msg = Message::new(KIND_PUSH, std::mem::take(chunk));
            msg.flags = FLAG_MORE;
            self.shared.link.send(&msg).map_err(link_err)?;
        }
        encode_range(r, chunk);
        Ok(())
    }
}

/// Longest run of pages one range of an RDMA push names, in bytes (1 MiB: one RDMA
/// READ of the lender's).
const RDMA_MAX_RUN: usize = 1 << 20;

/// Pulls the pages the function changed into guest memory: over TCP their bytes come in
/// the replies; over RDMA the lender wrote them already and the replies name their
/// ranges, which the shadow then takes from guest memory.
pub(super) fn pull(shared: &Borrowed, maps: &mut [GuestMap]) -> Result<(), LinkError> {
    if maps.is_empty() {
        return Ok(());
    }
    let replies = shared.link.call(Message::new(KIND_PULL, Vec::new()))?;
    let protocol = |e: devlend_fabric::WireError| LinkError::Protocol(e.to_string());
    let mut n = 0;
    let mut last_page: Option<u64> = None;
    for r in &replies {
        let moved: Vec<(u64, Option<&[u8]>, usize)> = match shared.link.page_moves() {
            PageMoves::Ranges => decode_ranges(&r.payload)
                .map_err(protocol)?
                .into_iter()
                .map(|x| (x.iova, None, x.len as usize))
                .collect(),
            PageMoves::Bytes => decode_pages(&r.payload)
                .map_err(protocol)?
                .into_iter()
                .map(|p| (p.iova, Some(p.data), p.data.len()))
                .collect(),
        };
        for (iova, data, len) in moved {
            let Some(m) = maps
                .iter_mut()
                .find(|m| iova >= m.iova && iova - m.iova + len as u64 <= m.size as u64)
            else {
                return Err(LinkError::Protocol(format!(
                    "pulled {len} bytes at IOVA {iova:#x} outside every mapping"
                )));
            };
            if !m.intact() {
                return Err(LinkError::Protocol(shrunk(m).to_string()));
            }
            let off = (iova - m.iova) as usize;
            // SAFETY: `ptr..ptr + size` is the map's live mapping while `m` lives; built
            // from the raw parts so that the shadow may be borrowed beside it.
            let slice = unsafe { VolatileSlice::new(m.ptr.as_ptr(), m.size) };
            if let Ok(s) = slice.subslice(off, len) {
                if let Some(d) = data {
                    s.copy_from(d);
                }
                // The mirror now holds what guest memory does.
                if let MapSync::Mirror { shadow } = &mut m.sync {
                    if let Some(shadow) = shadow.get_mut(off..off + len) {
                        match data {
                            Some(d) => shadow.copy_from_slice(d),
                            None => {
                                s.copy_to(shadow);
                            }
                        }
                    }
                }
            }
            // Pages, not runs: the runs of one page count it once (they come in order).
            let page = MIRROR_PAGE;
            let (first, end) = (iova / page, (iova + len as u64).div_ceil(page));
            let from = last_page.map_or(first, |l| first.max(l + 1));
            n += end.saturating_sub(from);
            last_page = Some(last_page.map_or(end - 1, |l| l.max(end - 1)));
        }
    }
    shared.stats.pages_pulled.fetch_add(n, Ordering::Relaxed);
    Ok(())
}
