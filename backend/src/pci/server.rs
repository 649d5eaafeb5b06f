//! The vfio-user side of a borrowed function: its socket, the VMM connections served
//! one after the other, and the requests of a VMM ([`ServerBackend`]): region reads and
//! writes forwarded to the lender, the rest handed to the `dma` and `irq` modules.

use std::fs::File;
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use devlend_fabric::pci::{
    Access, IrqAction, Message, INFO_MEDIATED, KIND_READ, KIND_RESET, KIND_WRITE,
};
use vfio_bindings::bindings::vfio::{vfio_region_info, VFIO_PCI_ROM_REGION_INDEX};
use vfio_user::{DmaMapFlags, DmaUnmapFlags, IrqInfo, Server, ServerBackend, ServerRegion};

use super::{einval, link_err, PciBorrower, PciError, MAX_DMA_MAPS};

impl PciBorrower {
    /// A vfio-user server for this function listening on `path` (which must not exist).
    ///
    /// # Errors
    /// [`PciError::Socket`].
    pub fn listen(&self, path: &Path) -> Result<Server, PciError> {
        let regions = self
            .shared
            .info
            .regions
            .iter()
            .enumerate()
            .map(|(i, r)| ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags: r.flags,
                    index: i as u32,
                    cap_offset: 0,
                    size: r.size,
                    offset: 0,
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            })
            .collect();
        let irqs = self
            .shared
            .info
            .irqs
            .iter()
            .enumerate()
            .map(|(i, q)| IrqInfo {
                index: i as u32,
                flags: q.flags,
                count: q.count,
            })
            .collect();
        Server::new(path, true, irqs, regions)
            .map(|s| s.with_max_dma_maps(MAX_DMA_MAPS))
            .map_err(|source| PciError::Socket {
                path: path.display().to_string(),
                source,
            })
    }

    /// Serves VMM connections on `server` one after the other, forever: when a VMM
    /// leaves, its DMA mappings and interrupts are dropped and the function reset, so
    /// that the next VMM finds it as new. Returns when the fabric session is gone.
    pub fn serve(&mut self, server: &Server) {
        loop {
            match server.run(self) {
                Ok(()) => devlend_fabric::limited!(info, "VMM left the vfio-user socket"),
                Err(e) => devlend_fabric::limited!(warn, error = %e, "vfio-user connection ended"),
            }
            if let Err(e) = self.vmm_gone() {
                tracing::warn!(error = %e, "the lender is gone; no more VMM connections");
                return;
            }
        }
    }

    /// Drops what a VMM set up: interrupts, DMA mappings, and resets the function.
    ///
    /// # Errors
    /// When the fabric session is gone.
    pub fn vmm_gone(&mut self) -> io::Result<()> {
        self.shared
            .eventfds
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let indexes: Vec<u32> = self
            .shared
            .lender_irqs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(i, _)| i)
            .collect();
        for index in indexes {
            self.irq_action(index, IrqAction::Disable, 0)?;
        }
        self.unmap_all()?;
        self.reset()
    }
}

/// The name of vfio-user command `c`, for the log.
fn command_name(c: u16) -> String {
    match vfio_user::Command::n(c) {
        Some(c) => format!("{c:?}"),
        None => format!("unknown ({c})"),
    }
}

impl ServerBackend for PciBorrower {
    fn refused(&mut self, command: u16, errno: u32, error: &vfio_user::Error) {
        let reason = match error {
            vfio_user::Error::Backend(e) => e.to_string(),
            e => e.to_string(),
        };
        devlend_fabric::limited!(
            info,
            command = %command_name(command),
            errno,
            %reason,
            "vfio-user request refused"
        );
    }

    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let max = self.shared.link.max_access() as usize;
        for (i, chunk) in data.chunks_mut(max).enumerate() {
            let off = offset
                .checked_add((i * max) as u64)
                .ok_or_else(|| einval("offset overflows"))?;
            let a = Access {
                region,
                len: chunk.len() as u32,
                offset: off,
            };
            let r = self
                .shared
                .link
                .call(Message::new(KIND_READ, a.encode()))
                .map_err(link_err)?;
            if r[0].payload.len() != chunk.len() {
                return Err(io::Error::other("short read from the lender"));
            }
            chunk.copy_from_slice(&r[0].payload);
        }
        self.shared.stats.reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        if region < VFIO_PCI_ROM_REGION_INDEX && self.shared.info.flags & INFO_MEDIATED == 0 {
            // A BAR write may start DMA: the mirror must hold guest memory first.
            let mut maps = self
                .shared
                .maps
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if !maps.is_empty() {
                self.push(&mut maps)?;
            }
        }
        let max = self.shared.link.max_access() as usize;
        for (i, chunk) in data.chunks(max).enumerate() {
            let off = offset
                .checked_add((i * max) as u64)
                .ok_or_else(|| einval("offset overflows"))?;
            let mut p = Access {
                region,
                len: chunk.len() as u32,
                offset: off,
            }
            .encode();
            p.extend_from_slice(chunk);
            self.shared
                .link
                .call(Message::new(KIND_WRITE, p))
                .map_err(link_err)?;
        }
        self.shared.stats.writes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn dma_map(
        &mut self,
        _flags: DmaMapFlags,
        offset: u64,
        address: u64,
        size: u64,
        fd: Option<File>,
    ) -> io::Result<()> {
        self.map_dma(offset, address, size, fd)
    }

    fn dma_unmap(&mut self, flags: DmaUnmapFlags, address: u64, size: u64) -> io::Result<()> {
        self.unmap_dma(flags.contains(DmaUnmapFlags::UNMAP_ALL), address, size)
    }

    fn reset(&mut self) -> io::Result<()> {
        self.shared
            .link
            .call(Message::new(KIND_RESET, Vec::new()))
            .map(|_| ())
            .map_err(link_err)
    }

    fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: Vec<File>,
    ) -> io::Result<()> {
        self.set_vmm_irqs(index, flags, start, count, fds)
    }
}
