//! The lend protocol's decoders on arbitrary bytes (devlend-fabric), and the gateway's.
//!
//! The first byte picks the decoder (mod 11), the rest is its input:
//! 0 `RequestHeader::decode`, 1 `ResponseHeader::decode`, 2 `Hello::read_from`,
//! 3 `HelloReply::read_from` (versions 1 and 2) and, on the same bytes,
//! `DeviceDescription::decode` (the version 2 reply's device description), 4 `LeaseToken::from_text` + `PublicKey::verify`,
//! 5 `PublicKey::verify` of the input signed with the fixed key (so that the claims
//! decoder behind the signature check sees arbitrary bytes too),
//! 6 the relay preamble's request as a gateway reads it from a borrower
//! (`RelayRequest::decode_prefix` then `decode_rest`, and `read_from`),
//! 7 the relay preamble's reply as a borrower reads it (`RelayReply::read_from`),
//! 8 one frame of a gateway link (devlend-gateway `mux`): `decode_header`, then for a
//! HELLO `LinkHello::decode` and for an OPEN the relay request in it
//! (`RelayRequest::decode`),
//! 9 a buffer of NIC frame messages (`net::decode`, message after message, as both ends
//! read them; each offload header also through the lender's `Offload::validate`),
//! 10 an RDMA request message (`rdma::decode_request`).
//!
//! Nothing may panic, and whatever decodes re-encodes to the bytes it came from: every
//! layout has one encoding per value (reserved bytes are 0, base64url has no padding and
//! no stray bits), so decoding accepts only canonical bytes. The exceptions are the
//! messages for people (`HelloReply`, `RelayReply`): one that is not UTF-8 is decoded
//! lossily, so only the rest of the message is compared; and a version 1 hello reply,
//! which is read into a device description and written back from it (the fields its
//! kind does not use are not kept), so that only its value must come back.
//!
//! The gateway's frame codec is compiled in by path (`gateway/src/mux/frame.rs` uses
//! only `std` and `devlend_fabric`), so that the gateway's runtime is not built here.

#![no_main]

use std::sync::LazyLock;

use devlend_fabric::lease_token::{LeaseToken, PublicKey, TokenSigner, SIGNING_CONTEXT};
use devlend_fabric::net::{self, NetMessage};
use devlend_fabric::rdma;
use devlend_fabric::relay::{
    RelayReply, RelayRequest, REPLY_FIXED_LEN as RELAY_REPLY_FIXED_LEN, REQUEST_FIXED_LEN,
};
use devlend_fabric::wire::{Op, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{DeviceDescription, Hello, HelloReply, RequestHeader, ResponseHeader};
use ed25519_dalek::{Signer, SigningKey};
use libfuzzer_sys::fuzz_target;

/// The gateway link's frame codec, the gateway's own source.
#[allow(dead_code)]
#[path = "../../gateway/src/mux/frame.rs"]
mod mux_frame;

/// The fixed pool key the tokens are checked with.
const SEED: [u8; 32] = [0x5e; 32];
/// Offset of a version 2 reply's `msg_len: u16`.
const REPLY_MSG_LEN_AT: usize = 16;

/// `DEVLEND_FUZZ_SHOW=1`: print what each input decodes to (to read a reproducer).
static SHOW: LazyLock<bool> = LazyLock::new(|| std::env::var_os("DEVLEND_FUZZ_SHOW").is_some());

static SIGNER: LazyLock<TokenSigner> = LazyLock::new(|| TokenSigner::from_seed(SEED));
static KEY: LazyLock<PublicKey> = LazyLock::new(|| SIGNER.public_key());
static RAW_KEY: LazyLock<SigningKey> = LazyLock::new(|| SigningKey::from_bytes(&SEED));

fuzz_target!(|data: &[u8]| {
    let Some((&which, data)) = data.split_first() else {
        return;
    };
    match which % 11 {
        0 => request_header(data),
        1 => response_header(data),
        2 => hello(data),
        3 => hello_reply(data),
        4 => token_text(data),
        5 => signed_token(data),
        6 => relay_request(data),
        7 => relay_reply(data),
        8 => mux_frame(data),
        9 => net_messages(data),
        _ => rdma_request(data),
    }
});

fn show(r: &impl std::fmt::Debug) {
    if *SHOW {
        eprintln!("-> {r:?}");
    }
}

fn request_header(data: &[u8]) {
    let Some(b) = data.first_chunk::<REQUEST_HEADER_LEN>() else {
        return;
    };
    let r = RequestHeader::decode(b);
    show(&r);
    if let Ok(h) = r {
        assert_eq!(&h.encode(), b, "{h:?} does not re-encode to its bytes");
    }
}

fn response_header(data: &[u8]) {
    let Some(b) = data.first_chunk::<RESPONSE_HEADER_LEN>() else {
        return;
    };
    let r = ResponseHeader::decode(b);
    show(&r);
    if let Ok(h) = r {
        assert_eq!(&h.encode(), b, "{h:?} does not re-encode to its bytes");
    }
}

/// Bytes `read_from` consumed from `data`, given what it left in `rest`.
fn consumed<'a>(data: &'a [u8], rest: &[u8]) -> &'a [u8] {
    &data[..data.len() - rest.len()]
}

fn hello(data: &[u8]) {
    let mut rest = data;
    let r = Hello::read_from(&mut rest);
    show(&r);
    if let Ok(h) = r {
        let mut out = Vec::new();
        h.write_to(&mut out).expect("a decoded hello encodes");
        assert_eq!(out, consumed(data, rest), "{h:?} does not re-encode");
    }
}

fn hello_reply(data: &[u8]) {
    description(data);
    let mut rest = data;
    let r = HelloReply::read_from(&mut rest);
    show(&r);
    let Ok(r) = r else {
        return;
    };
    let wire = consumed(data, rest);
    let mut out = Vec::new();
    r.write_to(&mut out).expect("a decoded reply encodes");
    // The value comes back (but for a lossily decoded message).
    let again = HelloReply::read_from(&mut out.as_slice()).expect("an encoded reply decodes");
    let quiet = |r: &HelloReply| HelloReply {
        message: String::new(),
        ..r.clone()
    };
    assert_eq!(quiet(&again), quiet(&r), "{r:?} does not decode back");
    if r.version == 1 {
        return;
    }
    // Version 2: the bytes come back too. The message is last; only a UTF-8 one has its
    // bytes back, else everything but it and its length is the same.
    let len_at = |b: &[u8]| {
        usize::from(u16::from_le_bytes([
            b[REPLY_MSG_LEN_AT],
            b[REPLY_MSG_LEN_AT + 1],
        ]))
    };
    let (body, msg) = wire.split_at(wire.len() - len_at(wire));
    if std::str::from_utf8(msg).is_ok() {
        assert_eq!(out, wire, "{r:?} does not re-encode");
    } else {
        let out_body = &out[..out.len() - len_at(&out)];
        assert_eq!(out_body[..REPLY_MSG_LEN_AT], body[..REPLY_MSG_LEN_AT]);
        assert_eq!(
            out_body[REPLY_MSG_LEN_AT + 2..],
            body[REPLY_MSG_LEN_AT + 2..]
        );
    }
}

/// A version 2 device description, alone: whatever decodes re-encodes to its bytes.
fn description(data: &[u8]) {
    let r = DeviceDescription::decode(data);
    show(&r);
    if let Ok(d) = r {
        let mut out = Vec::new();
        d.encode(&mut out).expect("a decoded description encodes");
        assert_eq!(out, data, "{d:?} does not re-encode");
    }
}

fn token_text(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let r = LeaseToken::from_text(text);
    show(&r);
    if let Ok(t) = r {
        assert_eq!(t.to_text(), text.trim(), "token text is not canonical");
        let r = KEY.verify(&t);
        show(&r);
        assert!(r.is_err(), "an unsigned token verified: {r:?}");
    }
}

fn signed_token(body: &[u8]) {
    let mut msg = SIGNING_CONTEXT.to_vec();
    msg.extend_from_slice(body);
    let mut token = body.to_vec();
    token.extend_from_slice(&RAW_KEY.sign(&msg).to_bytes());
    let r = KEY.verify(&LeaseToken::from_bytes(token.clone()));
    show(&r);
    if let Ok(claims) = r {
        let again = SIGNER.sign(&claims).expect("decoded claims sign");
        assert_eq!(again.as_bytes(), token, "{claims:?} does not re-encode");
    }
}

/// The preamble as `devlend-gateway` reads it from a borrower's connection (its fixed
/// part, then the names the fixed part announces), and as `read_from` does.
fn relay_request(data: &[u8]) {
    let Some((fixed, rest)) = data.split_first_chunk::<REQUEST_FIXED_LEN>() else {
        return;
    };
    let r = RelayRequest::decode_prefix(fixed).and_then(|p| {
        let names = rest
            .get(..p.rest_len())
            .ok_or(devlend_fabric::WireError::Truncated {
                got: rest.len(),
                want: p.rest_len(),
            })?;
        RelayRequest::decode_rest(p, names)
    });
    show(&r);
    let mut stream = data;
    let read = RelayRequest::read_from(&mut stream);
    assert_eq!(
        r.is_ok(),
        read.is_ok(),
        "{r:?} but read_from gives {read:?}"
    );
    if let Ok(req) = r {
        let wire = consumed(data, stream);
        assert_eq!(read.ok().as_ref(), Some(&req));
        let out = req.encode().expect("a decoded request encodes");
        assert_eq!(out, wire, "{req:?} does not re-encode");
        // The same bytes as one message (the OPEN of a relayed stream).
        assert_eq!(RelayRequest::decode(wire).ok(), Some(req));
    }
}

/// The gateway's answer to the preamble, as a borrower reads it.
fn relay_reply(data: &[u8]) {
    let mut rest = data;
    let r = RelayReply::read_from(&mut rest);
    show(&r);
    if let Ok(reply) = r {
        let wire = consumed(data, rest);
        let out = reply.encode();
        if std::str::from_utf8(&wire[RELAY_REPLY_FIXED_LEN..]).is_ok() {
            assert_eq!(out, wire, "{reply:?} does not re-encode");
        } else {
            // Lossy: magic, version and status are still the same.
            assert_eq!(out[..6], wire[..6]);
        }
    }
}

/// One frame of a link between two gateways: the header, then its payload as the
/// gateway reads it (the HELLO, the relay request of an OPEN).
fn mux_frame(data: &[u8]) {
    use mux_frame::{decode_header, LinkHello, FRAME_HEADER_LEN, KIND_HELLO, KIND_OPEN};
    let Some((hb, rest)) = data.split_first_chunk::<FRAME_HEADER_LEN>() else {
        return;
    };
    let r = decode_header(hb);
    show(&r);
    let Ok(h) = r else {
        return;
    };
    assert_eq!(
        &mux_frame::encode_header(h.kind, h.stream, h.len),
        hb,
        "{h:?} does not re-encode"
    );
    let Some(payload) = rest.get(..h.len as usize) else {
        return;
    };
    match h.kind {
        KIND_HELLO => {
            let r = LinkHello::decode(payload);
            show(&r);
            if let Ok(hello) = r {
                assert_eq!(
                    hello.encode(),
                    &data[..FRAME_HEADER_LEN + payload.len()],
                    "{hello:?} does not re-encode"
                );
            }
        }
        KIND_OPEN => {
            let r = RelayRequest::decode(payload);
            show(&r);
            if let Ok(req) = r {
                let out = req.encode().expect("a decoded request encodes");
                assert_eq!(out, payload, "{req:?} does not re-encode");
            }
        }
        _ => {}
    }
}

/// Frame messages of a lent NIC, one after the other as both ends read them.
fn net_messages(data: &[u8]) {
    let mut at = 0;
    while at < data.len() {
        let buf = &data[at..];
        let r = net::decode(buf);
        show(&r);
        let Ok(Some((m, n))) = r else {
            return;
        };
        assert!(n >= net::NET_HEADER_LEN && n <= buf.len(), "length {n}");
        // One byte short, the same message asks for more.
        assert!(
            matches!(net::decode(&buf[..n - 1]), Ok(None)),
            "{m:?} cut short does not ask for more"
        );
        let mut out = Vec::new();
        match m {
            NetMessage::Frame(f) => net::encode_frame(f, &mut out),
            NetMessage::Link(l) => l.encode(&mut out),
            NetMessage::OffloadFrame(o, f) => {
                // What the lender checks again on a frame from the borrower.
                let _ = o.validate(f.len(), false);
                let _ = o.taken_by(u32::from(f[0]) & 0xf);
                net::encode_offload_frame(&o, f, &mut out);
            }
            NetMessage::Offloads(bits) => net::encode_offloads(bits, &mut out),
            NetMessage::Heartbeat => net::encode_heartbeat(&mut out),
        }
        assert_eq!(out, &buf[..n], "message does not re-encode");
        at += n;
    }
}

/// A request message of the RDMA transport: header, segment count, segments.
fn rdma_request(data: &[u8]) {
    let mut segs = Vec::new();
    let r = rdma::decode_request(data, &mut segs);
    show(&r);
    let Ok(h) = r else {
        return;
    };
    let total: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
    match h.op() {
        Op::Read | Op::Write => assert_eq!(total, h.request.data_len().u64(), "{h:?} {segs:?}"),
        _ => assert!(segs.is_empty(), "{h:?} with segments {segs:?}"),
    }
    let mut out = vec![0u8; rdma::MAX_REQUEST_MSG];
    let n = rdma::encode_request(&h.encode(), &segs, &mut out);
    assert_eq!(&out[..n], data, "{h:?} {segs:?} does not re-encode");
}
