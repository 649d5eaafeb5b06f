// Copyright (C) 2019 Alibaba Cloud Computing. All rights reserved.
// SPDX-License-Identifier: Apache-2.0

use std::fs::File;
use std::mem;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::io::{AsRawFd, FromRawFd, IntoRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::slice;
use std::sync::{Arc, Mutex};

use vm_memory::ByteValued;

use super::backend_req::Backend;
use super::connection::Endpoint;
use super::gpu_backend_req::GpuBackend;
use super::message::*;
#[cfg(feature = "postcopy")]
use super::PostcopyState;
use super::{take_single_file, Error, Result};
use crate::backend::VhostUserMemoryRegionBase;

/// Services provided to the frontend by the backend with interior mutability.
///
/// The [VhostUserBackendReqHandler] trait defines the services provided to the frontend by the backend.
/// And the [VhostUserBackendReqHandlerMut] trait is a helper mirroring [VhostUserBackendReqHandler],
/// but without interior mutability.
/// The vhost-user specification defines a frontend communication channel, by which frontends could
/// request services from backends. The [VhostUserBackendReqHandler] trait defines services provided by
/// backends, and it's used both on the frontend side and backend side.
///
/// - on the frontend side, a stub forwarder implementing [VhostUserBackendReqHandler] will proxy
///   service requests to backends.
/// - on the backend side, the [BackendReqHandler] will forward service requests to a handler
///   implementing [VhostUserBackendReqHandler].
///
/// The [VhostUserBackendReqHandler] trait is design with interior mutability to improve performance
/// for multi-threading.
///
/// [VhostUserBackendReqHandler]: trait.VhostUserBackendReqHandler.html
/// [VhostUserBackendReqHandlerMut]: trait.VhostUserBackendReqHandlerMut.html
/// [BackendReqHandler]: struct.BackendReqHandler.html
#[allow(missing_docs)]
pub trait VhostUserBackendReqHandler {
    fn set_owner(&self) -> Result<()>;
    fn reset_owner(&self) -> Result<()>;
    fn reset_device(&self) -> Result<()>;
    fn get_features(&self) -> Result<u64>;
    fn set_features(&self, features: u64) -> Result<()>;
    fn set_mem_table(
        &self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>>;
    fn set_vring_num(&self, index: u32, num: u32) -> Result<()>;
    fn set_vring_addr(
        &self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> Result<()>;
    fn set_vring_base(&self, index: u32, base: u32) -> Result<()>;
    fn get_vring_base(&self, index: u32) -> Result<VhostUserVringState>;
    fn set_vring_kick(&self, index: u8, fd: Option<File>) -> Result<()>;
    fn set_vring_call(&self, index: u8, fd: Option<File>) -> Result<()>;
    fn set_vring_err(&self, index: u8, fd: Option<File>) -> Result<()>;

    fn get_protocol_features(&self) -> Result<VhostUserProtocolFeatures>;
    fn set_protocol_features(&self, features: u64) -> Result<()>;
    fn get_queue_num(&self) -> Result<u64>;
    fn set_vring_enable(&self, index: u32, enable: bool) -> Result<()>;
    fn get_config(&self, offset: u32, size: u32, flags: VhostUserConfigFlags) -> Result<Vec<u8>>;
    fn set_config(&self, offset: u32, buf: &[u8], flags: VhostUserConfigFlags) -> Result<()>;
    fn set_backend_req_fd(&self, _backend: Backend) {}
    fn set_gpu_socket(&self, _gpu_backend: GpuBackend) -> Result<()>;
    fn get_shared_object(&self, uuid: VhostUserSharedMsg) -> Result<File>;
    fn get_inflight_fd(&self, inflight: &VhostUserInflight) -> Result<(VhostUserInflight, File)>;
    fn set_inflight_fd(&self, inflight: &VhostUserInflight, file: File) -> Result<()>;
    fn get_max_mem_slots(&self) -> Result<u64>;
    fn add_mem_region(
        &self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>>;
    fn remove_mem_region(&self, region: &VhostUserSingleMemoryRegion) -> Result<()>;
    fn set_device_state_fd(
        &self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        fd: File,
    ) -> Result<Option<File>>;
    fn check_device_state(&self) -> Result<()>;
    fn get_shmem_config(&self) -> Result<VhostUserShMemConfig>;
    #[cfg(feature = "postcopy")]
    fn postcopy_advice(&self) -> Result<File>;
    #[cfg(feature = "postcopy")]
    fn postcopy_listen(&self) -> Result<()>;
    #[cfg(feature = "postcopy")]
    fn postcopy_end(&self) -> Result<()>;
    #[cfg(feature = "postcopy")]
    fn postcopy_ack_mem_regions(&self) -> Result<()>;
    fn set_log_base(&self, log: &VhostUserLog, file: File) -> Result<()>;
}

/// Services provided to the frontend by the backend without interior mutability.
///
/// This is a helper trait mirroring the [VhostUserBackendReqHandler] trait.
#[allow(missing_docs)]
pub trait VhostUserBackendReqHandlerMut {
    fn set_owner(&mut self) -> Result<()>;
    fn reset_owner(&mut self) -> Result<()>;
    fn reset_device(&mut self) -> Result<()>;
    fn get_features(&mut self) -> Result<u64>;
    fn set_features(&mut self, features: u64) -> Result<()>;
    fn set_mem_table(
        &mut self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>>;
    fn set_vring_num(&mut self, index: u32, num: u32) -> Result<()>;
    fn set_vring_addr(
        &mut self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> Result<()>;
    fn set_vring_base(&mut self, index: u32, base: u32) -> Result<()>;
    fn get_vring_base(&mut self, index: u32) -> Result<VhostUserVringState>;
    fn set_vring_kick(&mut self, index: u8, fd: Option<File>) -> Result<()>;
    fn set_vring_call(&mut self, index: u8, fd: Option<File>) -> Result<()>;
    fn set_vring_err(&mut self, index: u8, fd: Option<File>) -> Result<()>;

    fn get_protocol_features(&mut self) -> Result<VhostUserProtocolFeatures>;
    fn set_protocol_features(&mut self, features: u64) -> Result<()>;
    fn get_queue_num(&mut self) -> Result<u64>;
    fn set_vring_enable(&mut self, index: u32, enable: bool) -> Result<()>;
    fn get_config(
        &mut self,
        offset: u32,
        size: u32,
        flags: VhostUserConfigFlags,
    ) -> Result<Vec<u8>>;
    fn set_config(&mut self, offset: u32, buf: &[u8], flags: VhostUserConfigFlags) -> Result<()>;
    fn set_backend_req_fd(&mut self, _backend: Backend) {}
    fn set_gpu_socket(&mut self, _gpu_backend: GpuBackend) -> Result<()>;
    fn get_shared_object(&mut self, uuid: VhostUserSharedMsg) -> Result<File>;
    fn get_inflight_fd(
        &mut self,
        inflight: &VhostUserInflight,
    ) -> Result<(VhostUserInflight, File)>;
    fn set_inflight_fd(&mut self, inflight: &VhostUserInflight, file: File) -> Result<()>;
    fn get_max_mem_slots(&mut self) -> Result<u64>;
    fn add_mem_region(
        &mut self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>>;
    fn remove_mem_region(&mut self, region: &VhostUserSingleMemoryRegion) -> Result<()>;
    fn set_device_state_fd(
        &mut self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        fd: File,
    ) -> Result<Option<File>>;
    fn check_device_state(&mut self) -> Result<()>;
    fn get_shmem_config(&mut self) -> Result<VhostUserShMemConfig>;
    #[cfg(feature = "postcopy")]
    fn postcopy_advice(&mut self) -> Result<File>;
    #[cfg(feature = "postcopy")]
    fn postcopy_listen(&mut self) -> Result<()>;
    #[cfg(feature = "postcopy")]
    fn postcopy_end(&mut self) -> Result<()>;
    #[cfg(feature = "postcopy")]
    fn postcopy_ack_mem_regions(&mut self) -> Result<()>;
    fn set_log_base(&mut self, log: &VhostUserLog, file: File) -> Result<()>;
}

impl<T: VhostUserBackendReqHandlerMut> VhostUserBackendReqHandler for Mutex<T> {
    fn set_owner(&self) -> Result<()> {
        self.lock().unwrap().set_owner()
    }

    fn reset_owner(&self) -> Result<()> {
        self.lock().unwrap().reset_owner()
    }

    fn reset_device(&self) -> Result<()> {
        self.lock().unwrap().reset_device()
    }

    fn get_features(&self) -> Result<u64> {
        self.lock().unwrap().get_features()
    }

    fn set_features(&self, features: u64) -> Result<()> {
        self.lock().unwrap().set_features(features)
    }

    fn set_mem_table(
        &self,
        ctx: &[VhostUserMemoryRegion],
        files: Vec<File>,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<Vec<VhostUserMemoryRegionBase>>> {
        self.lock()
            .unwrap()
            .set_mem_table(ctx, files, postcopy_listening)
    }

    fn set_vring_num(&self, index: u32, num: u32) -> Result<()> {
        self.lock().unwrap().set_vring_num(index, num)
    }

    fn set_vring_addr(
        &self,
        index: u32,
        flags: VhostUserVringAddrFlags,
        descriptor: u64,
        used: u64,
        available: u64,
        log: u64,
    ) -> Result<()> {
        self.lock()
            .unwrap()
            .set_vring_addr(index, flags, descriptor, used, available, log)
    }

    fn set_vring_base(&self, index: u32, base: u32) -> Result<()> {
        self.lock().unwrap().set_vring_base(index, base)
    }

    fn get_vring_base(&self, index: u32) -> Result<VhostUserVringState> {
        self.lock().unwrap().get_vring_base(index)
    }

    fn set_vring_kick(&self, index: u8, fd: Option<File>) -> Result<()> {
        self.lock().unwrap().set_vring_kick(index, fd)
    }

    fn set_vring_call(&self, index: u8, fd: Option<File>) -> Result<()> {
        self.lock().unwrap().set_vring_call(index, fd)
    }

    fn set_vring_err(&self, index: u8, fd: Option<File>) -> Result<()> {
        self.lock().unwrap().set_vring_err(index, fd)
    }

    fn get_protocol_features(&self) -> Result<VhostUserProtocolFeatures> {
        self.lock().unwrap().get_protocol_features()
    }

    fn set_protocol_features(&self, features: u64) -> Result<()> {
        self.lock().unwrap().set_protocol_features(features)
    }

    fn get_queue_num(&self) -> Result<u64> {
        self.lock().unwrap().get_queue_num()
    }

    fn set_vring_enable(&self, index: u32, enable: bool) -> Result<()> {
        self.lock().unwrap().set_vring_enable(index, enable)
    }

    fn get_config(&self, offset: u32, size: u32, flags: VhostUserConfigFlags) -> Result<Vec<u8>> {
        self.lock().unwrap().get_config(offset, size, flags)
    }

    fn set_config(&self, offset: u32, buf: &[u8], flags: VhostUserConfigFlags) -> Result<()> {
        self.lock().unwrap().set_config(offset, buf, flags)
    }

    fn set_backend_req_fd(&self, backend: Backend) {
        self.lock().unwrap().set_backend_req_fd(backend)
    }

    fn set_gpu_socket(&self, gpu_backend: GpuBackend) -> Result<()> {
        self.lock().unwrap().set_gpu_socket(gpu_backend)
    }

    fn get_shared_object(&self, uuid: VhostUserSharedMsg) -> Result<File> {
        self.lock().unwrap().get_shared_object(uuid)
    }

    fn get_inflight_fd(&self, inflight: &VhostUserInflight) -> Result<(VhostUserInflight, File)> {
        self.lock().unwrap().get_inflight_fd(inflight)
    }

    fn set_inflight_fd(&self, inflight: &VhostUserInflight, file: File) -> Result<()> {
        self.lock().unwrap().set_inflight_fd(inflight, file)
    }

    fn get_max_mem_slots(&self) -> Result<u64> {
        self.lock().unwrap().get_max_mem_slots()
    }

    fn add_mem_region(
        &self,
        region: &VhostUserSingleMemoryRegion,
        fd: File,
        postcopy_listening: Option<bool>,
    ) -> Result<Option<VhostUserMemoryRegionBase>> {
        self.lock()
            .unwrap()
            .add_mem_region(region, fd, postcopy_listening)
    }

    fn remove_mem_region(&self, region: &VhostUserSingleMemoryRegion) -> Result<()> {
        self.lock().unwrap().remove_mem_region(region)
    }

    fn set_device_state_fd(
        &self,
        direction: VhostTransferStateDirection,
        phase: VhostTransferStatePhase,
        fd: File,
    ) -> Result<Option<File>> {
        self.lock()
            .unwrap()
            .set_device_state_fd(direction, phase, fd)
    }

    fn check_device_state(&self) -> Result<()> {
        self.lock().unwrap().check_device_state()
    }

    fn get_shmem_config(&self) -> Result<VhostUserShMemConfig> {
        self.lock().unwrap().get_shmem_config()
    }

    #[cfg(feature = "postcopy")]
    fn postcopy_advice(&self) -> Result<File> {
        self.lock().unwrap().postcopy_advice()
    }

    #[cfg(feature = "postcopy")]
    fn postcopy_listen(&self) -> Result<()> {
        self.lock().unwrap().postcopy_listen()
    }

    #[cfg(feature = "postcopy")]
    fn postcopy_end(&self) -> Result<()> {
        self.lock().unwrap().postcopy_end()
    }

    #[cfg(feature = "postcopy")]
    fn postcopy_ack_mem_regions(&self) -> Result<()> {
        self.lock().unwrap().postcopy_ack_mem_regions()
    }

    fn set_log_base(&self, log: &VhostUserLog, file: File) -> Result<()> {
        self.lock().unwrap().set_log_base(log, file)
    }
}

/// Server to handle service requests from frontends from the frontend communication channel.
///
/// The [BackendReqHandler] acts as a server on the backend side, to handle service requests from
/// frontends on the frontend communication channel. It's actually a proxy invoking the registered
/// handler implementing [VhostUserBackendReqHandler] to do the real work.
///
/// The lifetime of the BackendReqHandler object should be the same as the underline Unix Domain
/// Socket, so it gets simpler to recover from disconnect.
///
/// [VhostUserBackendReqHandler]: trait.VhostUserBackendReqHandler.html
/// [BackendReqHandler]: struct.BackendReqHandler.html
pub struct BackendReqHandler<S: VhostUserBackendReqHandler> {
    // underlying Unix domain socket for communication
    main_sock: Endpoint<VhostUserMsgHeader<FrontendReq>>,
    // the vhost-user backend device object
    backend: Arc<S>,

    virtio_features: u64,
    acked_virtio_features: u64,
    acked_protocol_features: u64,

    // sending ack for messages without payload
    reply_ack_enabled: bool,
    // devlend patch: SET_OWNER has been received (and RESET_OWNER has not since)
    owned: bool,
    // devlend patch: a reply to the request being handled has been sent
    replied: std::cell::Cell<bool>,
    // postcopy state reached through the POSTCOPY_* requests
    #[cfg(feature = "postcopy")]
    postcopy_state: PostcopyState,
    // whether the endpoint has encountered any failure
    error: Option<i32>,
}

impl<S: VhostUserBackendReqHandler> BackendReqHandler<S> {
    /// Create a vhost-user backend endpoint.
    pub(super) fn new(
        main_sock: Endpoint<VhostUserMsgHeader<FrontendReq>>,
        backend: Arc<S>,
    ) -> Self {
        BackendReqHandler {
            main_sock,
            backend,
            virtio_features: 0,
            acked_virtio_features: 0,
            acked_protocol_features: 0,
            reply_ack_enabled: false,
            owned: false,
            replied: std::cell::Cell::new(false),
            #[cfg(feature = "postcopy")]
            postcopy_state: PostcopyState::Inactive,
            error: None,
        }
    }

    // devlend patch: a split virtqueue's size is a power of two (virtio 1.2 §2.7), and
    // no queue is larger than 32768 (§2.7, §2.8).
    fn check_vring_num(&self, num: u32) -> Result<()> {
        let packed = self.acked_virtio_features & VIRTIO_F_RING_PACKED != 0;
        if num == 0 || num > MAX_VRING_NUM || (!packed && !num.is_power_of_two()) {
            return Err(Error::InvalidParam);
        }
        Ok(())
    }

    // devlend patch: for a split virtqueue, only bits 0-15 of the SET_VRING_BASE value
    // are used; bits 16-31 are reserved and set to zero.
    fn check_vring_base(&self, base: u32) -> Result<()> {
        let packed = self.acked_virtio_features & VIRTIO_F_RING_PACKED != 0;
        if !packed && base > u32::from(u16::MAX) {
            return Err(Error::InvalidParam);
        }
        Ok(())
    }

    // devlend patch: refuse a request in the way the protocol lets the back-end report
    // an error for it, and keep the session when the front-end has been told:
    // - the requests that have no reply of their own get a REPLY_ACK error when the
    //   front-end asked for it (need_reply);
    // - GET_CONFIG gets a reply with a zero-length payload, SET_DEVICE_STATE_FD and
    //   CHECK_DEVICE_STATE a non-zero value, GET_SHARED_OBJECT a reply without an fd.
    // - every other request with a reply body gets a reply without one (below).
    // An unknown code without need_reply has no reply: the error is returned and the
    // caller closes the connection.
    fn send_error_reply(
        &mut self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        err: Error,
    ) -> Result<()> {
        match hdr.get_code() {
            Ok(FrontendReq::GET_CONFIG) => {
                let reply = VhostUserConfig::new(0, 0, VhostUserConfigFlags::empty());
                self.send_reply_message(hdr, &reply)
            }
            Ok(FrontendReq::SET_DEVICE_STATE_FD) => {
                self.send_reply_message(hdr, &VhostUserU64::new(0x101))
            }
            Ok(FrontendReq::CHECK_DEVICE_STATE) => {
                self.send_reply_message(hdr, &VhostUserU64::new(1))
            }
            Ok(FrontendReq::GET_SHARED_OBJECT) => self.send_reply_message(hdr, &VhostUserEmpty),
            Ok(code) if !has_reply_body(code) => self.send_ack_message(hdr, Err(err)),
            // devlend patch: a request whose reply has a body and no error form of its
            // own (GET_VRING_BASE out of range, GET_FEATURES before its time, ...) gets
            // its reply with no body: the front-end asked for a reply and gets one, sees
            // that it is not the size the request's reply has, and fails that request
            // (QEMU: "Received bad msg size"); the session goes on.
            Ok(_) => self.send_reply_message(hdr, &VhostUserEmpty),
            // devlend patch: a request code this back-end does not know has no reply of
            // its own that it could know of; a front-end that asked for an ack gets a
            // failed one (spec "REPLY_ACK": the reply's request code is the request's).
            Err(_) if self.reply_ack_enabled && hdr.is_need_reply() => {
                self.check_state()?;
                let mut reply = *hdr;
                reply.set_reply(true);
                reply.set_need_reply(false);
                reply.set_size(mem::size_of::<VhostUserU64>() as u32);
                self.replied.set(true);
                self.main_sock
                    .send_message(&reply, &VhostUserU64::new(1), None)?;
                Ok(())
            }
            _ => Err(err),
        }
    }

    fn check_feature(&self, feat: VhostUserVirtioFeatures) -> Result<()> {
        if self.acked_virtio_features & feat.bits() != 0 {
            Ok(())
        } else {
            Err(Error::InactiveFeature(feat))
        }
    }

    fn check_proto_feature(&self, feat: VhostUserProtocolFeatures) -> Result<()> {
        if self.acked_protocol_features & feat.bits() != 0 {
            Ok(())
        } else {
            Err(Error::InactiveOperation(feat))
        }
    }

    /// Create a vhost-user backend endpoint from a connected socket.
    pub fn from_stream(socket: UnixStream, backend: Arc<S>) -> Self {
        Self::new(Endpoint::from_stream(socket), backend)
    }

    /// Create a new vhost-user backend endpoint.
    ///
    /// # Arguments
    /// * - `path` - path of Unix domain socket listener to connect to
    /// * - `backend` - handler for requests from the frontend to the backend
    pub fn connect(path: &str, backend: Arc<S>) -> Result<Self> {
        Ok(Self::new(
            Endpoint::<VhostUserMsgHeader<FrontendReq>>::connect(path)?,
            backend,
        ))
    }

    /// Clone the connection socket. Calling [`UnixStream::shutdown`] on the
    /// returned stream will unblock a concurrent `handle_request()`.
    pub fn try_clone_connection(&self) -> std::io::Result<UnixStream> {
        self.main_sock.try_clone_sock()
    }

    /// Mark endpoint as failed with specified error code.
    pub fn set_failed(&mut self, error: i32) {
        self.error = Some(error);
    }

    /// Main entrance to server backend request from the backend communication channel.
    ///
    /// Receive and handle one incoming request message from the frontend. The caller needs to:
    /// - serialize calls to this function
    /// - decide what to do when error happens
    /// - optional recover from failure
    pub fn handle_request(&mut self) -> Result<()> {
        // Return error if the endpoint is already in failed state.
        self.check_state()?;

        // The underlying communication channel is a Unix domain socket in
        // stream mode, and recvmsg() is a little tricky here. To successfully
        // receive attached file descriptors, we need to receive messages and
        // corresponding attached file descriptors in this way:
        // . recv messsage header and optional attached file
        // . validate message header
        // . recv optional message body and payload according size field in
        //   message header
        // . validate message body and optional payload
        // devlend patch: the header's code and flags are checked once the body is read.
        let (hdr, files) = self.main_sock.recv_header_framed()?;

        let (size, buf) = match hdr.get_size() {
            0 => (0, vec![0u8; 0]),
            len => {
                let (size2, rbuf) = self.main_sock.recv_data(len as usize)?;
                if size2 != len as usize {
                    return Err(Error::InvalidMessage);
                }
                (size2, rbuf)
            }
        };

        // devlend patch: SET_OWNER starts the session; before it only the feature
        // negotiation that QEMU does while it sets up the connection is accepted.
        if let Ok(code) = hdr.get_code() {
            if !self.owned && !allowed_without_owner(code) {
                return self.send_error_reply(&hdr, Error::InvalidOperation("no SET_OWNER"));
            }
        }

        // devlend patch: the whole message has been read, so the stream is still framed
        // whatever its body holds. A request refused before any reply went out (a body
        // of the wrong size, a value out of range, fds it does not take, an unknown
        // code) gets the error reply its form allows, and the session goes on where the
        // front-end could be told; errors of the socket itself still end it.
        self.replied.set(false);
        if !hdr.is_valid() {
            drop(files);
            return self.send_error_reply(&hdr, Error::InvalidMessage);
        }
        if let Err(e) = self.check_attached_files(&hdr, &files) {
            drop(files);
            return self.send_error_reply(&hdr, e);
        }
        match self.dispatch_request(&hdr, size, &buf, files) {
            Err(e) if !self.replied.get() && is_request_error(&e) => self.send_error_reply(&hdr, e),
            res => res,
        }
    }

    fn dispatch_request(
        &mut self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        size: usize,
        buf: &[u8],
        files: Option<Vec<File>>,
    ) -> Result<()> {
        let hdr = *hdr;
        match hdr.get_code() {
            Ok(FrontendReq::SET_OWNER) => {
                self.check_request_size(&hdr, size, 0)?;
                let res = self.backend.set_owner();
                if res.is_ok() {
                    self.owned = true;
                }
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::RESET_OWNER) => {
                self.check_request_size(&hdr, size, 0)?;
                let res = self.backend.reset_owner();
                self.owned = false;
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::RESET_DEVICE) => {
                self.check_request_size(&hdr, size, 0)?;
                let res = self
                    .check_proto_feature(VhostUserProtocolFeatures::RESET_DEVICE)
                    .and_then(|_| self.backend.reset_device());
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GET_FEATURES) => {
                self.check_request_size(&hdr, size, 0)?;
                let features = self.backend.get_features()?;
                let msg = VhostUserU64::new(features);
                self.send_reply_message(&hdr, &msg)?;
                self.virtio_features = features;
                self.update_reply_ack_flag();
            }
            Ok(FrontendReq::SET_FEATURES) => {
                let msg = self.extract_request_body::<VhostUserU64>(&hdr, size, &buf)?;
                let res = self.backend.set_features(msg.value);
                if res.is_ok() {
                    self.acked_virtio_features = msg.value;
                }
                self.update_reply_ack_flag();
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_MEM_TABLE) => {
                #[cfg(feature = "postcopy")]
                if self.postcopy_state == PostcopyState::Listen
                    && size == mem::size_of::<VhostUserU64>()
                {
                    let msg = self.extract_request_body::<VhostUserU64>(&hdr, size, &buf)?;
                    if msg.value != 0 {
                        return Err(Error::FrontendInternalError);
                    }
                    return self.backend.postcopy_ack_mem_regions();
                }
                match self.set_mem_table(&hdr, size, &buf, files) {
                    Ok(Some((body, payload))) => {
                        self.send_reply_with_payload(&hdr, &body, &payload)?
                    }
                    res => self.send_ack_message(&hdr, res.map(|_| ()))?,
                }
            }
            Ok(FrontendReq::SET_VRING_NUM) => {
                let msg = self.extract_request_body::<VhostUserVringState>(&hdr, size, &buf)?;
                let res = self
                    .check_vring_num(msg.num)
                    .and_then(|_| self.backend.set_vring_num(msg.index, msg.num));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_VRING_ADDR) => {
                let msg =
                    self.extract_request_body_unchecked::<VhostUserVringAddr>(&hdr, size, &buf)?;
                let res = VhostUserVringAddrFlags::from_bits(msg.flags)
                    .filter(|_| msg.is_valid())
                    .ok_or(Error::InvalidParam)
                    .and_then(|flags| {
                        self.backend.set_vring_addr(
                            msg.index,
                            flags,
                            msg.descriptor,
                            msg.used,
                            msg.available,
                            msg.log,
                        )
                    });
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_VRING_BASE) => {
                let msg = self.extract_request_body::<VhostUserVringState>(&hdr, size, &buf)?;
                let res = self
                    .check_vring_base(msg.num)
                    .and_then(|_| self.backend.set_vring_base(msg.index, msg.num));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GET_VRING_BASE) => {
                let msg = self.extract_request_body::<VhostUserVringState>(&hdr, size, &buf)?;
                let reply = self.backend.get_vring_base(msg.index)?;
                self.send_reply_message(&hdr, &reply)?;
            }
            Ok(FrontendReq::SET_VRING_CALL) => {
                self.check_request_size(&hdr, size, mem::size_of::<VhostUserU64>())?;
                let res = self
                    .handle_vring_fd_request(&buf, files)
                    .and_then(|(index, file)| self.backend.set_vring_call(index, file));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_VRING_KICK) => {
                self.check_request_size(&hdr, size, mem::size_of::<VhostUserU64>())?;
                let res = self
                    .handle_vring_fd_request(&buf, files)
                    .and_then(|(index, file)| self.backend.set_vring_kick(index, file));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_VRING_ERR) => {
                self.check_request_size(&hdr, size, mem::size_of::<VhostUserU64>())?;
                let res = self
                    .handle_vring_fd_request(&buf, files)
                    .and_then(|(index, file)| self.backend.set_vring_err(index, file));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GET_PROTOCOL_FEATURES) => {
                self.check_request_size(&hdr, size, 0)?;
                // REPLY_ACK is implemented entirely by this library, so it's always supported.
                let features =
                    self.backend.get_protocol_features()? | VhostUserProtocolFeatures::REPLY_ACK;

                // Enable the `XEN_MMAP` protocol feature for backends if xen feature is enabled.
                #[cfg(feature = "xen")]
                let features = features | VhostUserProtocolFeatures::XEN_MMAP;

                let msg = VhostUserU64::new(features.bits());
                self.send_reply_message(&hdr, &msg)?;
                self.update_reply_ack_flag();
            }
            Ok(FrontendReq::SET_PROTOCOL_FEATURES) => {
                let msg = self.extract_request_body::<VhostUserU64>(&hdr, size, &buf)?;
                let res = self.backend.set_protocol_features(msg.value);
                if res.is_ok() {
                    self.acked_protocol_features = msg.value;
                }
                self.update_reply_ack_flag();
                self.send_ack_message(&hdr, res)?;

                #[cfg(feature = "xen")]
                self.check_proto_feature(VhostUserProtocolFeatures::XEN_MMAP)?;
            }
            Ok(FrontendReq::GET_QUEUE_NUM) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::MQ) {
                    return self.send_error_reply(&hdr, e);
                }
                self.check_request_size(&hdr, size, 0)?;
                let num = self.backend.get_queue_num()?;
                let msg = VhostUserU64::new(num);
                self.send_reply_message(&hdr, &msg)?;
            }
            Ok(FrontendReq::SET_VRING_ENABLE) => {
                let msg = self.extract_request_body::<VhostUserVringState>(&hdr, size, &buf)?;
                // devlend patch: QEMU's vhost-user-net restores the ring enable state
                // before SET_FEATURES on a new connection; protocol features set with
                // SET_PROTOCOL_FEATURES show that bit 30 was negotiated.
                let res = if self.acked_protocol_features == 0 {
                    self.check_feature(VhostUserVirtioFeatures::PROTOCOL_FEATURES)
                } else {
                    Ok(())
                };
                let res = match (res, msg.num) {
                    (Err(e), _) => Err(e),
                    (Ok(()), 0) => self.backend.set_vring_enable(msg.index, false),
                    (Ok(()), 1) => self.backend.set_vring_enable(msg.index, true),
                    (Ok(()), _) => Err(Error::InvalidParam),
                };
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GET_CONFIG) => {
                self.check_request_size(&hdr, size, hdr.get_size() as usize)?;
                match self.check_proto_feature(VhostUserProtocolFeatures::CONFIG) {
                    Ok(()) => self.get_config(&hdr, &buf)?,
                    Err(e) => self.send_error_reply(&hdr, e)?,
                }
            }
            Ok(FrontendReq::SET_CONFIG) => {
                self.check_request_size(&hdr, size, hdr.get_size() as usize)?;
                let res = self
                    .check_proto_feature(VhostUserProtocolFeatures::CONFIG)
                    .and_then(|_| self.set_config(size, &buf));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_BACKEND_REQ_FD) => {
                self.check_request_size(&hdr, size, hdr.get_size() as usize)?;
                let res = self
                    .check_proto_feature(VhostUserProtocolFeatures::BACKEND_REQ)
                    .and_then(|_| self.set_backend_req_fd(files));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GET_SHARED_OBJECT) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::SHARED_OBJECT) {
                    return self.send_error_reply(&hdr, e);
                }
                self.check_request_size(&hdr, size, hdr.get_size() as usize)?;
                let msg = self.extract_request_body::<VhostUserSharedMsg>(&hdr, size, &buf)?;

                let reply_hdr = self.new_reply_header::<VhostUserEmpty>(&hdr, 0)?;
                match self.backend.get_shared_object(msg) {
                    Ok(file) => {
                        self.main_sock.send_message(
                            &reply_hdr,
                            &VhostUserEmpty,
                            Some(&[file.as_raw_fd()]),
                        )?;
                    }
                    Err(_) => {
                        self.main_sock
                            .send_message(&reply_hdr, &VhostUserEmpty, None)?;
                    }
                }
            }
            Ok(FrontendReq::GET_INFLIGHT_FD) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::INFLIGHT_SHMFD)
                {
                    return self.send_error_reply(&hdr, e);
                }

                let msg = self.extract_request_body::<VhostUserInflight>(&hdr, size, &buf)?;
                let (inflight, file) = self.backend.get_inflight_fd(&msg)?;
                let reply_hdr = self.new_reply_header::<VhostUserInflight>(&hdr, 0)?;
                self.main_sock
                    .send_message(&reply_hdr, &inflight, Some(&[file.as_raw_fd()]))?;
            }
            Ok(FrontendReq::SET_INFLIGHT_FD) => {
                let msg = self.extract_request_body::<VhostUserInflight>(&hdr, size, &buf)?;
                let res = self
                    .check_proto_feature(VhostUserProtocolFeatures::INFLIGHT_SHMFD)
                    .and_then(|_| take_single_file(files).ok_or(Error::IncorrectFds))
                    .and_then(|file| self.backend.set_inflight_fd(&msg, file));
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GPU_SET_SOCKET) => {
                let res = self.set_gpu_socket(files);
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::GET_MAX_MEM_SLOTS) => {
                if let Err(e) =
                    self.check_proto_feature(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
                {
                    return self.send_error_reply(&hdr, e);
                }
                self.check_request_size(&hdr, size, 0)?;
                let num = self.backend.get_max_mem_slots()?;
                let msg = VhostUserU64::new(num);
                self.send_reply_message(&hdr, &msg)?;
            }
            Ok(FrontendReq::ADD_MEM_REG) => {
                if let Err(e) =
                    self.check_proto_feature(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
                {
                    return self.send_error_reply(&hdr, e);
                }
                #[cfg(feature = "postcopy")]
                if self.postcopy_state == PostcopyState::Listen
                    && size == mem::size_of::<VhostUserU64>()
                {
                    let msg = self.extract_request_body::<VhostUserU64>(&hdr, size, &buf)?;
                    if msg.value != 0 {
                        return Err(Error::FrontendInternalError);
                    }
                    return self.backend.postcopy_ack_mem_regions();
                }
                let msg = self.extract_request_body_unchecked::<VhostUserSingleMemoryRegion>(
                    &hdr, size, &buf,
                )?;
                let mut files = match files {
                    Some(files) if files.len() == 1 && msg.is_valid() => files,
                    _ => return self.send_error_reply(&hdr, Error::InvalidParam),
                };
                let res = self.backend.add_mem_region(
                    &msg,
                    files.swap_remove(0),
                    #[cfg(feature = "postcopy")]
                    Some(self.postcopy_state == PostcopyState::Listen),
                    #[cfg(not(feature = "postcopy"))]
                    None,
                );
                #[cfg(feature = "postcopy")]
                if self.postcopy_state == PostcopyState::Listen {
                    match res.and_then(|base| base.ok_or(Error::BackendInternalError)) {
                        Ok(base) => {
                            let reply = VhostUserSingleMemoryRegion::new(
                                msg.guest_phys_addr,
                                msg.memory_size,
                                base,
                                msg.mmap_offset,
                                #[cfg(feature = "xen")]
                                msg.xen_mmap_flags,
                                #[cfg(feature = "xen")]
                                msg.xen_mmap_data,
                            );
                            self.send_reply_message(&hdr, &reply)?;
                        }
                        Err(e) => self.send_ack_message(&hdr, Err(e))?,
                    }
                    return Ok(());
                }
                self.send_ack_message(&hdr, res.map(|_| ()))?;
            }
            // QEMU acks a batch with the code of its last message.
            #[cfg(feature = "postcopy")]
            Ok(FrontendReq::REM_MEM_REG)
                if self.postcopy_state == PostcopyState::Listen
                    && size == mem::size_of::<VhostUserU64>() =>
            {
                if let Err(e) =
                    self.check_proto_feature(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
                {
                    return self.send_error_reply(&hdr, e);
                }
                let msg = self.extract_request_body::<VhostUserU64>(&hdr, size, &buf)?;
                if msg.value != 0 {
                    return Err(Error::FrontendInternalError);
                }
                self.backend.postcopy_ack_mem_regions()?;
            }
            Ok(FrontendReq::REM_MEM_REG) => {
                if let Err(e) =
                    self.check_proto_feature(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS)
                {
                    return self.send_error_reply(&hdr, e);
                }

                let msg =
                    self.extract_request_body::<VhostUserSingleMemoryRegion>(&hdr, size, &buf)?;
                let res = self.backend.remove_mem_region(&msg);
                self.send_ack_message(&hdr, res)?;
            }
            Ok(FrontendReq::SET_DEVICE_STATE_FD) => {
                let msg =
                    self.extract_request_body::<VhostUserTransferDeviceState>(&hdr, size, &buf)?;
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::DEVICE_STATE) {
                    return self.send_error_reply(&hdr, e);
                }
                let Some(file) = take_single_file(files) else {
                    return self.send_error_reply(&hdr, Error::IncorrectFds);
                };
                let reply_hdr = self.new_reply_header::<VhostUserU64>(&hdr, 0)?;

                let direction: VhostTransferStateDirection = msg
                    .direction
                    .try_into()
                    .map_err(|_| Error::InvalidMessage)?;
                let phase: VhostTransferStatePhase =
                    msg.phase.try_into().map_err(|_| Error::InvalidMessage)?;
                let res = self.backend.set_device_state_fd(direction, phase, file);

                // The value returned is both an indication for success, and whether a file
                // descriptor for a back-end-provided channel is returned: Bits 0–7 are 0 on
                // success, and non-zero on error. Bit 8 is the invalid FD flag; this flag is
                // set when there is no file descriptor returned.
                match res {
                    Ok(None) => {
                        let msg = VhostUserU64::new(0x100); // set invalid FD flag
                        self.main_sock.send_message(&reply_hdr, &msg, None)?;
                    }
                    Ok(Some(file)) => {
                        let msg = VhostUserU64::new(0);
                        self.main_sock
                            .send_message(&reply_hdr, &msg, Some(&[file.as_raw_fd()]))?;
                    }
                    Err(_) => {
                        let msg = VhostUserU64::new(0x101);
                        self.main_sock.send_message(&reply_hdr, &msg, None)?;
                    }
                }
            }
            Ok(FrontendReq::CHECK_DEVICE_STATE) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::DEVICE_STATE) {
                    return self.send_error_reply(&hdr, e);
                }
                let res = self.backend.check_device_state();

                // We must return a value in the payload to indicate success or error:
                // 0 is success, any non-zero value is an error.
                let msg = match res {
                    Ok(_) => VhostUserU64::new(0),
                    Err(_) => VhostUserU64::new(1),
                };
                self.send_reply_message(&hdr, &msg)?;
            }
            Ok(FrontendReq::GET_SHMEM_CONFIG) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::SHMEM) {
                    return self.send_error_reply(&hdr, e);
                }
                let msg = self.backend.get_shmem_config()?;
                self.send_reply_message(&hdr, &msg)?;
            }
            #[cfg(feature = "postcopy")]
            Ok(FrontendReq::POSTCOPY_ADVISE) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::PAGEFAULT) {
                    return self.send_error_reply(&hdr, e);
                }
                if self.postcopy_state != PostcopyState::Inactive {
                    return Err(Error::InvalidOperation("postcopy already advised"));
                }

                let reply_hdr = self.new_reply_header::<VhostUserEmpty>(&hdr, 0)?;
                let res = self.backend.postcopy_advice();
                match res {
                    Ok(uffd_file) => {
                        self.postcopy_state = PostcopyState::Advise;
                        self.main_sock.send_message(
                            &reply_hdr,
                            &VhostUserEmpty,
                            Some(&[uffd_file.as_raw_fd()]),
                        )?
                    }
                    Err(_) => self
                        .main_sock
                        .send_message(&reply_hdr, &VhostUserEmpty, None)?,
                }
            }
            #[cfg(feature = "postcopy")]
            Ok(FrontendReq::POSTCOPY_LISTEN) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::PAGEFAULT) {
                    return self.send_error_reply(&hdr, e);
                }
                if self.postcopy_state != PostcopyState::Advise {
                    return Err(Error::InvalidOperation("postcopy not advised"));
                }
                let res = self.backend.postcopy_listen();
                if res.is_ok() {
                    self.postcopy_state = PostcopyState::Listen;
                }
                self.send_ack_message(&hdr, res)?;
            }
            #[cfg(feature = "postcopy")]
            Ok(FrontendReq::POSTCOPY_END) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::PAGEFAULT) {
                    return self.send_error_reply(&hdr, e);
                }
                if self.postcopy_state != PostcopyState::Listen {
                    return Err(Error::InvalidOperation("postcopy not listening"));
                }
                self.postcopy_state = PostcopyState::End;
                let res = self.backend.postcopy_end();
                self.send_ack_message(&hdr, res)?;
            }
            // Sets logging shared memory space.
            // When the back-end has `VHOST_USER_PROTOCOL_F_LOG_SHMFD` protocol feature, the log
            // memory `fd` is provided in the ancillary data of `VHOST_USER_SET_LOG_BASE` message,
            // the size and offset of shared memory area provided in the message.
            // See https://qemu-project.gitlab.io/qemu/interop/vhost-user.html#migration.
            Ok(FrontendReq::SET_LOG_BASE) => {
                if let Err(e) = self.check_proto_feature(VhostUserProtocolFeatures::LOG_SHMFD) {
                    return self.send_error_reply(&hdr, e);
                }
                let file = take_single_file(files).ok_or(Error::IncorrectFds)?;
                let msg = self.extract_request_body::<VhostUserLog>(&hdr, size, &buf)?;
                self.backend.set_log_base(&msg, file)?;
                self.send_reply_message(&hdr, &msg)?;
            }
            _ => {
                return Err(Error::InvalidMessage);
            }
        }
        Ok(())
    }

    fn set_mem_table(
        &mut self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        size: usize,
        buf: &[u8],
        files: Option<Vec<File>>,
    ) -> Result<Option<(VhostUserMemory, Vec<u8>)>> {
        self.check_request_size(hdr, size, hdr.get_size() as usize)?;

        // check message size is consistent
        let hdrsize = mem::size_of::<VhostUserMemory>();
        if size < hdrsize {
            return Err(Error::InvalidMessage);
        }
        // SAFETY: Safe because we checked that `buf` size is at least that of
        // VhostUserMemory.
        let msg = unsafe { &*(buf.as_ptr() as *const VhostUserMemory) };
        if !msg.is_valid() {
            return Err(Error::InvalidMessage);
        }
        if size != hdrsize + msg.num_regions as usize * mem::size_of::<VhostUserMemoryRegion>() {
            return Err(Error::InvalidMessage);
        }

        // devlend patch: without CONFIGURE_MEM_SLOTS a front-end sends at most
        // VHOST_USER_MAX_RAM_SLOTS (8) regions; with it, at most what GET_MAX_MEM_SLOTS
        // offered.
        let max_regions = if self.acked_protocol_features
            & VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS.bits()
            != 0
        {
            self.backend
                .get_max_mem_slots()?
                .min(MAX_ATTACHED_FD_ENTRIES as u64)
        } else {
            BASELINE_MEM_REGIONS
        };
        if u64::from(msg.num_regions) > max_regions {
            return Err(Error::InvalidParam);
        }

        // validate number of fds matching number of memory regions
        let files = files.ok_or(Error::InvalidMessage)?;
        if files.len() != msg.num_regions as usize {
            return Err(Error::InvalidMessage);
        }

        // Validate memory regions
        //
        // SAFETY: Safe because we checked that `buf` size is equal to that of
        // VhostUserMemory, plus `msg.num_regions` elements of VhostUserMemoryRegion.
        let regions = unsafe {
            slice::from_raw_parts(
                buf.as_ptr().add(hdrsize) as *const VhostUserMemoryRegion,
                msg.num_regions as usize,
            )
        };
        for region in regions.iter() {
            if !region.is_valid() {
                return Err(Error::InvalidMessage);
            }
        }
        // devlend patch: no two regions may cover the same guest physical address.
        let mut ranges: Vec<(u64, u64)> = regions
            .iter()
            .map(|r| (r.guest_phys_addr, r.guest_phys_addr + r.memory_size))
            .collect();
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err(Error::InvalidParam);
        }

        #[cfg(feature = "postcopy")]
        if self.postcopy_state == PostcopyState::Listen {
            let bases = self
                .backend
                .set_mem_table(regions, files, Some(true))?
                .ok_or(Error::BackendInternalError)?;
            if bases.len() != regions.len() {
                return Err(Error::BackendInternalError);
            }

            let mut payload = Vec::with_capacity(mem::size_of_val(regions));
            for (region, base) in regions.iter().zip(bases) {
                let mut region = *region;
                region.user_addr = base;
                payload.extend_from_slice(region.as_slice());
            }
            return Ok(Some((VhostUserMemory::new(regions.len() as u32), payload)));
        }

        self.backend.set_mem_table(
            regions,
            files,
            #[cfg(feature = "postcopy")]
            Some(false),
            #[cfg(not(feature = "postcopy"))]
            None,
        )?;
        Ok(None)
    }

    fn get_config(&mut self, hdr: &VhostUserMsgHeader<FrontendReq>, buf: &[u8]) -> Result<()> {
        let payload_offset = mem::size_of::<VhostUserConfig>();
        if buf.len() > MAX_MSG_SIZE || buf.len() < payload_offset {
            return self.send_error_reply(hdr, Error::InvalidMessage);
        }
        // SAFETY: Safe because we checked that `buf` size is at least that of VhostUserConfig.
        let msg = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const VhostUserConfig) };
        // devlend patch: a request the back-end cannot serve (size 0, offset + size
        // overflowing or beyond the config space, unknown flags, a payload of another
        // size) gets the error reply of the spec, a zero-length payload, rather than
        // a closed connection.
        let flags = match VhostUserConfigFlags::from_bits(msg.flags) {
            Some(flags) if msg.is_valid() && buf.len() - payload_offset == msg.size as usize => {
                flags
            }
            _ => {
                let reply = VhostUserConfig::new(msg.offset, 0, VhostUserConfigFlags::empty());
                return self.send_reply_message(hdr, &reply);
            }
        };
        let res = self.backend.get_config(msg.offset, msg.size, flags);

        // vhost-user backend's payload size MUST match frontend's request
        // on success, uses zero length of payload to indicate an error
        // to vhost-user frontend.
        match res {
            Ok(ref buf) if buf.len() == msg.size as usize => {
                let reply = VhostUserConfig::new(msg.offset, buf.len() as u32, flags);
                self.send_reply_with_payload(hdr, &reply, buf.as_slice())?;
            }
            Ok(_) => {
                let reply = VhostUserConfig::new(msg.offset, 0, flags);
                self.send_reply_message(hdr, &reply)?;
            }
            Err(_) => {
                let reply = VhostUserConfig::new(msg.offset, 0, flags);
                self.send_reply_message(hdr, &reply)?;
            }
        }
        Ok(())
    }

    fn set_config(&mut self, size: usize, buf: &[u8]) -> Result<()> {
        if size > MAX_MSG_SIZE || size < mem::size_of::<VhostUserConfig>() {
            return Err(Error::InvalidMessage);
        }
        // SAFETY: Safe because we checked that `buf` size is at least that of VhostUserConfig.
        let msg = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const VhostUserConfig) };
        if !msg.is_valid() {
            return Err(Error::InvalidMessage);
        }
        if size - mem::size_of::<VhostUserConfig>() != msg.size as usize {
            return Err(Error::InvalidMessage);
        }
        let flags = VhostUserConfigFlags::from_bits(msg.flags).ok_or(Error::InvalidMessage)?;

        self.backend
            .set_config(msg.offset, &buf[mem::size_of::<VhostUserConfig>()..], flags)
    }

    fn set_backend_req_fd(&mut self, files: Option<Vec<File>>) -> Result<()> {
        let file = take_single_file(files).ok_or(Error::InvalidMessage)?;
        // Validate that the received file descriptor is an AF_UNIX SOCK_STREAM
        // socket as required by the vhost-user backend request channel.
        validate_unix_stream_socket_fd(file.as_fd())?;
        // SAFETY:
        // Ownership of the file descriptor is transferred from `File` via
        // `into_raw_fd()`, ensuring this code is the sole owner of the FD.
        // The descriptor has been validated to be an AF_UNIX SOCK_STREAM socket,
        // so it is safe to construct a `UnixStream` from it.
        let sock = unsafe { UnixStream::from_raw_fd(file.into_raw_fd()) };
        let backend = Backend::from_stream(sock);
        self.backend.set_backend_req_fd(backend);
        Ok(())
    }

    fn set_gpu_socket(&mut self, files: Option<Vec<File>>) -> Result<()> {
        let file = take_single_file(files).ok_or(Error::InvalidMessage)?;
        // Validate that the received file descriptor is an AF_UNIX SOCK_STREAM
        // socket as required by the vhost-user GPU channel.
        validate_unix_stream_socket_fd(file.as_fd())?;
        // SAFETY:
        // Ownership of the file descriptor is transferred from `File` via
        // `into_raw_fd()`, ensuring this code is the sole owner of the FD.
        // The descriptor has been validated to be an AF_UNIX SOCK_STREAM socket,
        // so it is safe to construct a `UnixStream` from it.
        let sock = unsafe { UnixStream::from_raw_fd(file.into_raw_fd()) };
        let gpu_backend = GpuBackend::from_stream(sock);
        self.backend.set_gpu_socket(gpu_backend)
    }

    fn handle_vring_fd_request(
        &mut self,
        buf: &[u8],
        files: Option<Vec<File>>,
    ) -> Result<(u8, Option<File>)> {
        if buf.len() > MAX_MSG_SIZE || buf.len() < mem::size_of::<VhostUserU64>() {
            return Err(Error::InvalidMessage);
        }
        // SAFETY: Safe because we checked that `buf` size is at least that of VhostUserU64.
        let msg = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const VhostUserU64) };
        if !msg.is_valid() {
            return Err(Error::InvalidMessage);
        }

        // Bits (0-7) of the payload contain the vring index. Bit 8 is the
        // invalid FD flag. This bit is set when there is no file descriptor
        // in the ancillary data. This signals that polling will be used
        // instead of waiting for the call.
        // If Bit 8 is unset, the data must contain a file descriptor.
        let has_fd = (msg.value & 0x100u64) == 0;
        // devlend patch: bits 9-63 are not defined; a value with one set is no vring
        // index (it would otherwise be truncated to bits 0-7).
        if msg.value & !0x1ffu64 != 0 {
            return Err(Error::InvalidParam);
        }

        let file = take_single_file(files);

        if has_fd && file.is_none() || !has_fd && file.is_some() {
            return Err(Error::InvalidMessage);
        }

        Ok((msg.value as u8, file))
    }

    fn check_state(&self) -> Result<()> {
        match self.error {
            Some(e) => Err(Error::SocketBroken(std::io::Error::from_raw_os_error(e))),
            None => Ok(()),
        }
    }

    fn check_request_size(
        &self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        size: usize,
        expected: usize,
    ) -> Result<()> {
        if hdr.get_size() as usize != expected
            || hdr.is_reply()
            || hdr.get_version() != 0x1
            || size != expected
        {
            return Err(Error::InvalidMessage);
        }
        Ok(())
    }

    fn check_attached_files(
        &self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        files: &Option<Vec<File>>,
    ) -> Result<()> {
        match hdr.get_code() {
            Ok(
                FrontendReq::SET_MEM_TABLE
                | FrontendReq::SET_VRING_CALL
                | FrontendReq::SET_VRING_KICK
                | FrontendReq::SET_VRING_ERR
                | FrontendReq::SET_LOG_BASE
                | FrontendReq::SET_LOG_FD
                | FrontendReq::SET_BACKEND_REQ_FD
                | FrontendReq::SET_INFLIGHT_FD
                | FrontendReq::ADD_MEM_REG
                // Needed for spec compatibility against older incorrect implementations:
                // "No file descriptors SHOULD be passed in the ancillary data. For compatibility
                // with existing incorrect implementations, the back-end MAY accept messages with
                // one file descriptor. If a file descriptor is passed, the back-end MUST close it
                // without using it otherwise."
                | FrontendReq::REM_MEM_REG
                | FrontendReq::SET_DEVICE_STATE_FD
                | FrontendReq::GPU_SET_SOCKET,
            ) => Ok(()),
            _ if files.is_some() => Err(Error::InvalidMessage),
            _ => Ok(()),
        }
    }

    // devlend patch: like extract_request_body, but leaves the validation of the values
    // to the caller, so that it can answer an error instead of closing the connection.
    fn extract_request_body_unchecked<T: Sized + VhostUserMsgValidator>(
        &self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        size: usize,
        buf: &[u8],
    ) -> Result<T> {
        self.check_request_size(hdr, size, mem::size_of::<T>())?;
        // SAFETY: Safe because we checked that `buf` size is equal to T size.
        Ok(unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const T) })
    }

    fn extract_request_body<T: Sized + VhostUserMsgValidator>(
        &self,
        hdr: &VhostUserMsgHeader<FrontendReq>,
        size: usize,
        buf: &[u8],
    ) -> Result<T> {
        self.check_request_size(hdr, size, mem::size_of::<T>())?;
        // SAFETY: Safe because we checked that `buf` size is equal to T size.
        let msg = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const T) };
        if !msg.is_valid() {
            return Err(Error::InvalidMessage);
        }
        Ok(msg)
    }

    fn update_reply_ack_flag(&mut self) {
        let vflag = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let pflag = VhostUserProtocolFeatures::REPLY_ACK;

        self.reply_ack_enabled = (self.virtio_features & vflag) != 0
            && (self.acked_protocol_features & pflag.bits()) != 0;
    }

    fn new_reply_header<T: Sized>(
        &self,
        req: &VhostUserMsgHeader<FrontendReq>,
        payload_size: usize,
    ) -> Result<VhostUserMsgHeader<FrontendReq>> {
        if mem::size_of::<T>() > MAX_MSG_SIZE
            || payload_size > MAX_MSG_SIZE
            || mem::size_of::<T>() + payload_size > MAX_MSG_SIZE
        {
            return Err(Error::InvalidParam);
        }
        self.check_state()?;
        self.replied.set(true);
        Ok(VhostUserMsgHeader::new(
            req.get_code()?,
            VhostUserHeaderFlag::REPLY.bits(),
            (mem::size_of::<T>() + payload_size) as u32,
        ))
    }

    fn send_ack_message(
        &mut self,
        req: &VhostUserMsgHeader<FrontendReq>,
        res: Result<()>,
    ) -> Result<()> {
        if self.reply_ack_enabled && req.is_need_reply() {
            let hdr = self.new_reply_header::<VhostUserU64>(req, 0)?;
            let val = match res {
                Ok(_) => 0,
                Err(_) => 1,
            };
            let msg = VhostUserU64::new(val);
            self.main_sock.send_message(&hdr, &msg, None)?;
            // devlend patch: the front-end has been told of the error; the session
            // goes on (the request had no effect). Without REPLY_ACK the error
            // cannot be reported, and the caller closes the connection.
            return Ok(());
        }
        res
    }

    fn send_reply_message<T: ByteValued>(
        &mut self,
        req: &VhostUserMsgHeader<FrontendReq>,
        msg: &T,
    ) -> Result<()> {
        let hdr = self.new_reply_header::<T>(req, 0)?;
        self.main_sock.send_message(&hdr, msg, None)?;
        Ok(())
    }

    fn send_reply_with_payload<T: ByteValued>(
        &mut self,
        req: &VhostUserMsgHeader<FrontendReq>,
        msg: &T,
        payload: &[u8],
    ) -> Result<()> {
        let hdr = self.new_reply_header::<T>(req, payload.len())?;
        self.main_sock
            .send_message_with_payload(&hdr, msg, payload, None)?;
        Ok(())
    }
}

impl<S: VhostUserBackendReqHandler> AsRawFd for BackendReqHandler<S> {
    fn as_raw_fd(&self) -> RawFd {
        self.main_sock.as_raw_fd()
    }
}

// devlend patch: VIRTIO_F_RING_PACKED (virtio 1.2 §6).
const VIRTIO_F_RING_PACKED: u64 = 1 << 34;
// devlend patch: the largest virtqueue (virtio 1.2 §2.7, §2.8: "Queue Size" is at
// most 32768).
const MAX_VRING_NUM: u32 = 32768;
// devlend patch: VHOST_USER_MAX_RAM_SLOTS of SET_MEM_TABLE without
// VHOST_USER_PROTOCOL_F_CONFIGURE_MEM_SLOTS (QEMU's VHOST_MEMORY_BASELINE_NREGIONS).
const BASELINE_MEM_REGIONS: u64 = 8;

// devlend patch: the requests a front-end sends before SET_OWNER: QEMU negotiates the
// features, reads the queue count and the slots and sets up the back-end channel first.
fn allowed_without_owner(code: FrontendReq) -> bool {
    matches!(
        code,
        FrontendReq::SET_OWNER
            | FrontendReq::RESET_OWNER
            | FrontendReq::GET_FEATURES
            | FrontendReq::GET_PROTOCOL_FEATURES
            | FrontendReq::SET_PROTOCOL_FEATURES
            | FrontendReq::GET_QUEUE_NUM
            | FrontendReq::GET_MAX_MEM_SLOTS
            | FrontendReq::GET_SHMEM_CONFIG
            | FrontendReq::SET_BACKEND_REQ_FD
    )
}

// devlend patch: the requests answered with a reply of their own, for which REPLY_ACK
// changes nothing (the spec's "Communication" and REPLY_ACK sections).
// devlend patch: an error that says the request was wrong (refused before any reply
// went out), as opposed to one of the socket or the connection's state.
fn is_request_error(e: &Error) -> bool {
    matches!(
        e,
        Error::InvalidParam
            | Error::InvalidOperation(_)
            | Error::InactiveFeature(_)
            | Error::InactiveOperation(_)
            | Error::InvalidMessage
            | Error::IncorrectFds
            | Error::ReqHandlerError(_)
            | Error::FeatureMismatch
    )
}

fn has_reply_body(code: FrontendReq) -> bool {
    matches!(
        code,
        FrontendReq::GET_FEATURES
            | FrontendReq::GET_PROTOCOL_FEATURES
            | FrontendReq::GET_VRING_BASE
            | FrontendReq::GET_QUEUE_NUM
            | FrontendReq::GET_CONFIG
            | FrontendReq::GET_INFLIGHT_FD
            | FrontendReq::GET_SHARED_OBJECT
            | FrontendReq::GET_MAX_MEM_SLOTS
            | FrontendReq::SET_DEVICE_STATE_FD
            | FrontendReq::CHECK_DEVICE_STATE
            | FrontendReq::GET_SHMEM_CONFIG
            | FrontendReq::SET_LOG_BASE
            | FrontendReq::POSTCOPY_ADVISE
    )
}

// Retrieve a SOL_SOCKET socket option value using `getsockopt`.
fn get_socket_opt(fd: BorrowedFd<'_>, opt: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;

    // SAFETY:
    // - `value` and `len` point to valid writable memory.
    // - `len` is initialized to `size_of::<libc::c_int>()`, matching the size
    //   of `value`, so `getsockopt()` will not write past the end of `value`.
    // - `fd.as_raw_fd()` is valid because `BorrowedFd` guarantees a live file
    //   descriptor for the duration of the call.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            std::ptr::addr_of_mut!(value).cast::<libc::c_void>(),
            std::ptr::addr_of_mut!(len),
        )
    };

    if rc == -1 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(value)
    }
}

// Validate that the given file descriptor is an AF_UNIX SOCK_STREAM socket.
fn validate_unix_stream_socket_fd(fd: BorrowedFd<'_>) -> Result<()> {
    let domain = get_socket_opt(fd, libc::SO_DOMAIN).map_err(Error::InvalidSocketFd)?;
    if domain != libc::AF_UNIX {
        return Err(Error::NotUnixSocket);
    }

    let sock_type = get_socket_opt(fd, libc::SO_TYPE).map_err(Error::InvalidSocketFd)?;
    if sock_type != libc::SOCK_STREAM {
        return Err(Error::NotStreamSocket);
    }

    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::os::unix::io::AsRawFd;

    use super::*;
    use crate::vhost_user::dummy_backend::DummyBackendReqHandler;

    #[test]
    fn test_backend_req_handler_new() {
        let (p1, _p2) = UnixStream::pair().unwrap();
        let endpoint = Endpoint::<VhostUserMsgHeader<FrontendReq>>::from_stream(p1);
        let backend = Arc::new(Mutex::new(DummyBackendReqHandler::new()));
        let mut handler = BackendReqHandler::new(endpoint, backend);

        handler.check_state().unwrap();
        handler.set_failed(libc::EAGAIN);
        handler.check_state().unwrap_err();
        assert!(handler.as_raw_fd() >= 0);
    }

    // Helper to send GET_SHMEM_CONFIG request and receive response
    fn send_get_shmem_config_request(
        mut endpoint: Endpoint<VhostUserMsgHeader<FrontendReq>>,
    ) -> VhostUserShMemConfig {
        let hdr = VhostUserMsgHeader::new(FrontendReq::GET_SHMEM_CONFIG, 0, 0);
        endpoint.send_message(&hdr, &VhostUserEmpty, None).unwrap();

        let (reply_hdr, reply_config, rfds) = endpoint.recv_body::<VhostUserShMemConfig>().unwrap();
        assert_eq!(reply_hdr.get_code().unwrap(), FrontendReq::GET_SHMEM_CONFIG);
        assert!(reply_hdr.is_reply());
        assert!(rfds.is_none());
        reply_config
    }

    // Helper to create handler with SHMEM protocol feature enabled
    fn create_handler_with_shmem(
        backend: Arc<Mutex<DummyBackendReqHandler>>,
        p1: UnixStream,
    ) -> BackendReqHandler<Mutex<DummyBackendReqHandler>> {
        let mut handler = BackendReqHandler::new(
            Endpoint::<VhostUserMsgHeader<FrontendReq>>::from_stream(p1),
            backend,
        );
        handler.acked_protocol_features = VhostUserProtocolFeatures::SHMEM.bits();
        handler
    }

    #[test]
    fn test_get_shmem_config_multiple_regions() {
        let memory_sizes = [
            0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000, 0x8000,
        ];
        let config = VhostUserShMemConfig::new(8, &memory_sizes);

        let (p1, p2) = UnixStream::pair().unwrap();
        let mut dummy_backend = DummyBackendReqHandler::new();
        dummy_backend.set_shmem_config(config);
        let mut handler = create_handler_with_shmem(Arc::new(Mutex::new(dummy_backend)), p1);

        let handle = std::thread::spawn(move || {
            send_get_shmem_config_request(Endpoint::<VhostUserMsgHeader<FrontendReq>>::from_stream(
                p2,
            ))
        });

        handler.handle_request().unwrap();

        let reply_config = handle.join().unwrap();
        assert_eq!(reply_config.nregions, 8);
        for i in 0..8 {
            assert_eq!(reply_config.memory_sizes[i], (i as u64 + 1) * 0x1000);
        }
        for i in 8..256 {
            assert_eq!(reply_config.memory_sizes[i], 0);
        }
    }

    #[test]
    fn test_get_shmem_config_non_continuous_regions() {
        // Create a configuration with non-continuous regions
        let memory_sizes = [0x10000, 0, 0x20000, 0, 0, 0, 0, 0];
        let config = VhostUserShMemConfig::new(2, &memory_sizes);

        let (p1, p2) = UnixStream::pair().unwrap();
        let mut dummy_backend = DummyBackendReqHandler::new();
        dummy_backend.set_shmem_config(config);
        let mut handler = create_handler_with_shmem(Arc::new(Mutex::new(dummy_backend)), p1);

        let handle = std::thread::spawn(move || {
            send_get_shmem_config_request(Endpoint::<VhostUserMsgHeader<FrontendReq>>::from_stream(
                p2,
            ))
        });

        handler.handle_request().unwrap();

        let reply_config = handle.join().unwrap();
        assert_eq!(reply_config.nregions, 2);
        assert_eq!(reply_config.memory_sizes[0], 0x10000);
        assert_eq!(reply_config.memory_sizes[1], 0);
        assert_eq!(reply_config.memory_sizes[2], 0x20000);
        for i in 3..256 {
            assert_eq!(reply_config.memory_sizes[i], 0);
        }
    }

    #[test]
    fn test_get_shmem_config_feature_not_negotiated() {
        // Test that the request fails when SHMEM protocol feature is not negotiated
        let (p1, p2) = UnixStream::pair().unwrap();
        let backend = Arc::new(Mutex::new(DummyBackendReqHandler::new()));
        let mut handler = BackendReqHandler::new(
            Endpoint::<VhostUserMsgHeader<FrontendReq>>::from_stream(p1),
            backend,
        );
        let mut frontend_endpoint = Endpoint::<VhostUserMsgHeader<FrontendReq>>::from_stream(p2);

        let hdr = VhostUserMsgHeader::new(FrontendReq::GET_SHMEM_CONFIG, 0, 0);
        frontend_endpoint
            .send_message(&hdr, &VhostUserEmpty, None)
            .unwrap();
        // devlend: refused with a reply without a body; the session goes on.
        handler.handle_request().unwrap();
        let (reply, _) = frontend_endpoint.recv_header().unwrap();
        assert!(reply.is_reply());
        assert_eq!(reply.get_code().unwrap(), FrontendReq::GET_SHMEM_CONFIG);
        assert_eq!(reply.get_size(), 0);
    }

    // devlend: a handler past SET_OWNER with REPLY_ACK and `proto` negotiated, and the
    // front-end's end of its socket.
    fn ready_handler(
        proto: VhostUserProtocolFeatures,
    ) -> (
        BackendReqHandler<Mutex<DummyBackendReqHandler>>,
        Endpoint<VhostUserMsgHeader<FrontendReq>>,
    ) {
        let (p1, p2) = UnixStream::pair().unwrap();
        let mut dummy = DummyBackendReqHandler::new();
        dummy.owned = true;
        dummy.acked_protocol_features = (proto | VhostUserProtocolFeatures::REPLY_ACK).bits();
        let mut handler = BackendReqHandler::from_stream(p1, Arc::new(Mutex::new(dummy)));
        handler.owned = true;
        handler.virtio_features = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        handler.acked_virtio_features = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        handler.acked_protocol_features = (proto | VhostUserProtocolFeatures::REPLY_ACK).bits();
        handler.update_reply_ack_flag();
        (handler, Endpoint::from_stream(p2))
    }

    // devlend: send a request with need_reply; the handler must handle it and keep the
    // session; return the REPLY_ACK value (0: success).
    fn ack_of<T: ByteValued>(
        handler: &mut BackendReqHandler<Mutex<DummyBackendReqHandler>>,
        ep: &mut Endpoint<VhostUserMsgHeader<FrontendReq>>,
        code: FrontendReq,
        body: &T,
        payload: &[u8],
        fds: Option<&[RawFd]>,
    ) -> u64 {
        let size = (mem::size_of::<T>() + payload.len()) as u32;
        let hdr = VhostUserMsgHeader::new(code, VhostUserHeaderFlag::NEED_REPLY.bits(), size);
        ep.send_message_with_payload(&hdr, body, payload, fds)
            .unwrap();
        handler.handle_request().unwrap();
        let (reply, ack, files) = ep.recv_body::<VhostUserU64>().unwrap();
        assert!(reply.is_reply_for(&hdr));
        assert!(files.is_none());
        ack.value
    }

    fn state(index: u32, num: u32) -> VhostUserVringState {
        VhostUserVringState::new(index, num)
    }

    #[test]
    fn test_set_vring_num_refused_without_closing() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::empty());
        let num = FrontendReq::SET_VRING_NUM;
        // Not a power of two, zero, beyond the queue's maximum.
        for bad in [3, 100, 0, 65535, 512] {
            assert_ne!(
                ack_of(&mut handler, &mut ep, num, &state(0, bad), &[], None),
                0
            );
        }
        assert_eq!(
            ack_of(&mut handler, &mut ep, num, &state(0, 128), &[], None),
            0
        );
        assert_eq!(handler.backend.lock().unwrap().vring_num[0], 128);
        // A packed queue's size need not be a power of two.
        handler.acked_virtio_features |= VIRTIO_F_RING_PACKED;
        assert_eq!(
            ack_of(&mut handler, &mut ep, num, &state(0, 100), &[], None),
            0
        );
    }

    // devlend: a request whose body has the wrong size, one carrying fds it does not
    // take, and one of a code the back-end does not know were read whole, so the stream
    // is still framed: each gets a failed REPLY_ACK and the session goes on. Before the
    // change each closed the connection (handle_request returned the error).
    #[test]
    fn test_malformed_requests_get_error_ack_without_closing() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::empty());
        let num = FrontendReq::SET_VRING_NUM;
        // A SET_VRING_NUM 4 bytes short, and 4 bytes long.
        assert_eq!(
            ack_of(&mut handler, &mut ep, num, &VhostUserEmpty, &[0u8; 4], None),
            1
        );
        assert_eq!(
            ack_of(&mut handler, &mut ep, num, &state(0, 128), &[0u8; 4], None),
            1
        );
        // A SET_VRING_ADDR with a body of the wrong size.
        let addr = FrontendReq::SET_VRING_ADDR;
        assert_eq!(ack_of(&mut handler, &mut ep, addr, &state(0, 0), &[], None), 1);
        // A SET_VRING_NUM that carries an fd: refused, and the fd closed.
        let (fd_end, peer) = UnixStream::pair().unwrap();
        assert_eq!(
            ack_of(
                &mut handler,
                &mut ep,
                num,
                &state(0, 128),
                &[],
                Some(&[fd_end.as_raw_fd()])
            ),
            1
        );
        drop(fd_end);
        let mut b = [0u8; 1];
        assert_eq!(
            std::io::Read::read(&mut &peer, &mut b).unwrap(),
            0,
            "the fd sent with a request that takes none is closed"
        );
        // An unknown request code, asking for an ack.
        let mut unknown = VhostUserMsgHeader::new(
            FrontendReq::SET_VRING_NUM,
            VhostUserHeaderFlag::NEED_REPLY.bits(),
            8,
        );
        unknown.set_raw_code(0x0fff);
        ep.send_message(&unknown, &VhostUserU64::new(0), None)
            .unwrap();
        handler.handle_request().unwrap();
        // The reply names the unknown code: read it without the code check.
        let (reply, _) = ep.recv_header_framed().unwrap();
        assert!(reply.is_reply());
        assert_eq!(reply.raw_code(), 0x0fff);
        assert_eq!(reply.get_size(), 8);
        let (n, ack) = ep.recv_data(8).unwrap();
        assert_eq!(n, 8);
        assert_eq!(u64::from_le_bytes(ack[..8].try_into().unwrap()), 1);
        // The session goes on.
        assert_eq!(
            ack_of(&mut handler, &mut ep, num, &state(0, 128), &[], None),
            0
        );
        // Without REPLY_ACK there is no way to say it: the connection is closed.
        handler.reply_ack_enabled = false;
        let hdr = VhostUserMsgHeader::new(num, 0, 4);
        ep.send_message_with_payload(&hdr, &VhostUserEmpty, &[0u8; 4], None)
            .unwrap();
        assert!(handler.handle_request().is_err());
    }

    // Send GET_CONFIG; the handler must keep the session; return the reply's size field
    // and payload length.
    fn get_config_reply(
        handler: &mut BackendReqHandler<Mutex<DummyBackendReqHandler>>,
        ep: &mut Endpoint<VhostUserMsgHeader<FrontendReq>>,
        offset: u32,
        size: u32,
        payload_len: usize,
    ) -> (u32, usize) {
        let body = VhostUserConfig::new(offset, size, VhostUserConfigFlags::WRITABLE);
        let payload = vec![0u8; payload_len];
        let len = (mem::size_of::<VhostUserConfig>() + payload_len) as u32;
        let hdr = VhostUserMsgHeader::new(FrontendReq::GET_CONFIG, 0, len);
        ep.send_message_with_payload(&hdr, &body, &payload, None)
            .unwrap();
        handler.handle_request().unwrap();
        let (reply, _) = ep.recv_header().unwrap();
        assert!(reply.is_reply_for(&hdr));
        let (n, buf) = ep.recv_data(reply.get_size() as usize).unwrap();
        assert!(n >= mem::size_of::<VhostUserConfig>());
        // SAFETY: `buf` holds at least a VhostUserConfig, checked above.
        let cfg = unsafe { std::ptr::read_unaligned(buf.as_ptr() as *const VhostUserConfig) };
        (cfg.size, n - mem::size_of::<VhostUserConfig>())
    }

    #[test]
    fn test_get_config_invalid_gets_empty_reply() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::CONFIG);
        // offset + size overflows
        assert_eq!(
            get_config_reply(&mut handler, &mut ep, u32::MAX - 1, 4, 4),
            (0, 0)
        );
        // size 0
        assert_eq!(get_config_reply(&mut handler, &mut ep, 0x100, 0, 0), (0, 0));
        // beyond the config space
        assert_eq!(
            get_config_reply(&mut handler, &mut ep, 0x100, 0x1000, 0xf00),
            (0, 0)
        );
        // a payload shorter than the size asked for
        assert_eq!(get_config_reply(&mut handler, &mut ep, 0x100, 4, 2), (0, 0));
        // refused by the back-end (outside its config space)
        assert_eq!(get_config_reply(&mut handler, &mut ep, 0x80, 4, 4), (0, 0));
        // and a valid one still works
        assert_eq!(get_config_reply(&mut handler, &mut ep, 0x100, 4, 4), (4, 4));
    }

    #[test]
    fn test_set_config_backend_error_is_error_ack() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::CONFIG);
        let code = FrontendReq::SET_CONFIG;
        let flags = VhostUserConfigFlags::WRITABLE;
        // The back-end refuses offset 0x80.
        let body = VhostUserConfig::new(0x80, 4, flags);
        assert_ne!(
            ack_of(&mut handler, &mut ep, code, &body, &[0xa5; 4], None),
            0
        );
        // Overflowing offset + size.
        let body = VhostUserConfig::new(u32::MAX, 4, flags);
        assert_ne!(
            ack_of(&mut handler, &mut ep, code, &body, &[0xa5; 4], None),
            0
        );
        let body = VhostUserConfig::new(0x100, 4, flags);
        assert_eq!(
            ack_of(&mut handler, &mut ep, code, &body, &[0xa5; 4], None),
            0
        );
    }

    // Send SET_MEM_TABLE with `regions` and `nfds` descriptors (ends of socket pairs);
    // return the ack, and whether every descriptor sent was closed by the back-end.
    fn set_mem_table_ack(
        handler: &mut BackendReqHandler<Mutex<DummyBackendReqHandler>>,
        ep: &mut Endpoint<VhostUserMsgHeader<FrontendReq>>,
        regions: &[(u64, u64)],
        nfds: usize,
    ) -> (u64, bool) {
        let mut payload = Vec::new();
        for (i, (gpa, size)) in regions.iter().enumerate() {
            let region = VhostUserMemoryRegion::new(*gpa, *size, 0x1000_0000 * (i as u64 + 1), 0);
            payload.extend_from_slice(region.as_slice());
        }
        let pairs: Vec<(UnixStream, UnixStream)> =
            (0..nfds).map(|_| UnixStream::pair().unwrap()).collect();
        let fds: Vec<RawFd> = pairs.iter().map(|(a, _)| a.as_raw_fd()).collect();
        let body = VhostUserMemory::new(regions.len() as u32);
        let fds = if fds.is_empty() { None } else { Some(&fds[..]) };
        let ack = ack_of(
            handler,
            ep,
            FrontendReq::SET_MEM_TABLE,
            &body,
            &payload,
            fds,
        );
        let mut closed = true;
        for (sent, peer) in pairs {
            drop(sent);
            peer.set_nonblocking(true).unwrap();
            let mut byte = [0u8; 1];
            // EOF once the back-end has closed its copy too.
            closed &= matches!(std::io::Read::read(&mut &peer, &mut byte), Ok(0));
        }
        (ack, closed)
    }

    #[test]
    fn test_set_mem_table_refused() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::empty());
        let mb = 0x10_0000u64;
        let nine: Vec<(u64, u64)> = (0..9).map(|i| (i * mb, mb)).collect();
        let refused = [
            // more regions than VHOST_USER_MAX_RAM_SLOTS without CONFIGURE_MEM_SLOTS
            (nine.clone(), 9),
            // fewer fds than regions, more fds than regions
            (vec![(0, mb), (mb, mb)], 1),
            (vec![(0, mb)], 2),
            // overlapping regions
            (vec![(0, 2 * mb), (mb, mb)], 2),
            // a region of size 0, a region whose end overflows
            (vec![(0, 0)], 1),
            (vec![(u64::MAX - mb + 2, mb)], 1),
        ];
        for (regions, nfds) in refused {
            let (ack, closed) = set_mem_table_ack(&mut handler, &mut ep, &regions, nfds);
            assert_ne!(ack, 0, "{regions:x?} with {nfds} fds acked");
            assert!(closed, "{regions:x?}: fds left open");
        }
        let (ack, _) = set_mem_table_ack(&mut handler, &mut ep, &[(0, mb), (mb, mb)], 2);
        assert_eq!(ack, 0);

        // With CONFIGURE_MEM_SLOTS, as many as GET_MAX_MEM_SLOTS offers (up to the fds
        // a message can carry).
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS);
        let (ack, _) = set_mem_table_ack(&mut handler, &mut ep, &nine, 9);
        assert_eq!(ack, 0);
    }

    #[test]
    fn test_vring_requests_out_of_range() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::empty());
        let bad = 5; // the dummy back-end has 2 queues
        for code in [
            FrontendReq::SET_VRING_NUM,
            FrontendReq::SET_VRING_BASE,
            FrontendReq::SET_VRING_ENABLE,
        ] {
            assert_ne!(
                ack_of(&mut handler, &mut ep, code, &state(bad, 1), &[], None),
                0
            );
        }
        let addr = VhostUserVringAddr::new(
            bad,
            VhostUserVringAddrFlags::empty(),
            0x1000,
            0x2000,
            0x3000,
            0,
        );
        let code = FrontendReq::SET_VRING_ADDR;
        assert_ne!(ack_of(&mut handler, &mut ep, code, &addr, &[], None), 0);
        // A misaligned descriptor table.
        let addr = VhostUserVringAddr::new(0, VhostUserVringAddrFlags::empty(), 8, 0, 0, 0);
        assert_ne!(ack_of(&mut handler, &mut ep, code, &addr, &[], None), 0);
        for code in [
            FrontendReq::SET_VRING_KICK,
            FrontendReq::SET_VRING_CALL,
            FrontendReq::SET_VRING_ERR,
        ] {
            // index 5 without fd; index 0 with undefined bits; index 0 marked "no fd"
            // but with one.
            let no_fd = VhostUserU64::new(0x100 | u64::from(bad));
            assert_ne!(ack_of(&mut handler, &mut ep, code, &no_fd, &[], None), 0);
            let undefined_bits = VhostUserU64::new(0x1_0000_0100);
            assert_ne!(
                ack_of(&mut handler, &mut ep, code, &undefined_bits, &[], None),
                0
            );
            let (fd, _peer) = UnixStream::pair().unwrap();
            let fds = [fd.as_raw_fd()];
            let no_fd = VhostUserU64::new(0x100);
            assert_ne!(
                ack_of(&mut handler, &mut ep, code, &no_fd, &[], Some(&fds)),
                0
            );
        }
        // A split queue's base has 16 bits.
        let code = FrontendReq::SET_VRING_BASE;
        assert_ne!(
            ack_of(&mut handler, &mut ep, code, &state(0, 0x1_0000), &[], None),
            0
        );
        assert_eq!(
            ack_of(&mut handler, &mut ep, code, &state(0, 0x10), &[], None),
            0
        );

        // GET_VRING_BASE has no error reply in the spec: it gets its reply without a
        // body (the front-end fails that request), and the session goes on.
        let hdr = VhostUserMsgHeader::new(FrontendReq::GET_VRING_BASE, 0, 8);
        ep.send_message(&hdr, &state(bad, 0), None).unwrap();
        handler.handle_request().unwrap();
        let (reply, _) = ep.recv_header().unwrap();
        assert_eq!(reply.get_code().unwrap(), FrontendReq::GET_VRING_BASE);
        assert_eq!(reply.get_size(), 0);
        assert_eq!(
            ack_of(&mut handler, &mut ep, code, &state(0, 0x10), &[], None),
            0
        );
    }

    #[test]
    fn test_requests_before_owner_or_feature_refused() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::CONFIG);
        handler.owned = false;
        // Feature negotiation is allowed before SET_OWNER.
        let hdr = VhostUserMsgHeader::new(FrontendReq::GET_FEATURES, 0, 0);
        ep.send_message(&hdr, &VhostUserEmpty, None).unwrap();
        handler.handle_request().unwrap();
        let (reply, _, _) = ep.recv_body::<VhostUserU64>().unwrap();
        assert!(reply.is_reply_for(&hdr));
        // Anything else is refused.
        let num = FrontendReq::SET_VRING_NUM;
        assert_ne!(
            ack_of(&mut handler, &mut ep, num, &state(0, 64), &[], None),
            0
        );
        let features = VhostUserU64::new(VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits());
        let code = FrontendReq::SET_FEATURES;
        assert_ne!(ack_of(&mut handler, &mut ep, code, &features, &[], None), 0);
        assert_eq!(get_config_reply(&mut handler, &mut ep, 0x100, 4, 4), (0, 0));
        assert_eq!(handler.backend.lock().unwrap().vring_num[0], 0);

        handler.backend.lock().unwrap().owned = false;
        let owner = FrontendReq::SET_OWNER;
        assert_eq!(
            ack_of(&mut handler, &mut ep, owner, &VhostUserEmpty, &[], None),
            0
        );
        assert_eq!(
            ack_of(&mut handler, &mut ep, num, &state(0, 64), &[], None),
            0
        );

        // A request whose protocol feature was not negotiated.
        let code = FrontendReq::RESET_DEVICE;
        assert_ne!(
            ack_of(&mut handler, &mut ep, code, &VhostUserEmpty, &[], None),
            0
        );
        let hdr = VhostUserMsgHeader::new(FrontendReq::CHECK_DEVICE_STATE, 0, 0);
        ep.send_message(&hdr, &VhostUserEmpty, None).unwrap();
        handler.handle_request().unwrap();
        let (reply, value, _) = ep.recv_body::<VhostUserU64>().unwrap();
        assert!(reply.is_reply_for(&hdr));
        assert_ne!(value.value, 0);
    }

    #[test]
    fn test_refused_set_features_not_recorded() {
        let (mut handler, mut ep) = ready_handler(VhostUserProtocolFeatures::empty());
        // The dummy back-end does not offer VIRTIO_F_RING_PACKED and refuses it.
        let features = VhostUserU64::new(VIRTIO_F_RING_PACKED);
        let code = FrontendReq::SET_FEATURES;
        assert_ne!(ack_of(&mut handler, &mut ep, code, &features, &[], None), 0);
        assert_eq!(handler.acked_virtio_features & VIRTIO_F_RING_PACKED, 0);
        // So queues are still split ones, with power-of-two sizes.
        let num = FrontendReq::SET_VRING_NUM;
        assert_ne!(
            ack_of(&mut handler, &mut ep, num, &state(0, 100), &[], None),
            0
        );
    }

    #[test]
    fn test_validate_unix_stream_socket_fd() {
        // Valid AF_UNIX SOCK_STREAM socket
        let (sock1, _sock2) = UnixStream::pair().unwrap();
        assert!(validate_unix_stream_socket_fd(sock1.as_fd()).is_ok());

        // AF_INET socket (wrong domain)
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        assert!(validate_unix_stream_socket_fd(listener.as_fd()).is_err());

        // Non-socket file descriptor
        let file = File::open("/dev/null").unwrap();
        assert!(validate_unix_stream_socket_fd(file.as_fd()).is_err());

        // AF_UNIX but SOCK_DGRAM (wrong type)
        let dgram = std::os::unix::net::UnixDatagram::unbound().unwrap();
        assert!(validate_unix_stream_socket_fd(dgram.as_fd()).is_err());
    }
}
