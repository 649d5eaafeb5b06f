//! The lend protocol's decoders on arbitrary bytes (devlend-fabric).
//!
//! The first byte picks the decoder, the rest is its input:
//! 0 `RequestHeader::decode`, 1 `ResponseHeader::decode`, 2 `Hello::read_from`,
//! 3 `HelloReply::read_from`, 4 `LeaseToken::from_text` + `PublicKey::verify`,
//! 5 `PublicKey::verify` of the input signed with the fixed key (so that the claims
//! decoder behind the signature check sees arbitrary bytes too).
//!
//! Nothing may panic, and whatever decodes re-encodes to the bytes it came from: every
//! layout has one encoding per value (reserved bytes are 0, base64url has no padding and
//! no stray bits), so decoding accepts only canonical bytes.

#![no_main]

use std::sync::LazyLock;

use devlend_fabric::lease_token::{LeaseToken, PublicKey, TokenSigner, SIGNING_CONTEXT};
use devlend_fabric::wire::{REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN};
use devlend_fabric::{Hello, HelloReply, RequestHeader, ResponseHeader};
use ed25519_dalek::{Signer, SigningKey};
use libfuzzer_sys::fuzz_target;

/// The fixed pool key the tokens are checked with.
const SEED: [u8; 32] = [0x5e; 32];
/// Fixed length of a [`HelloReply`] before its message.
const REPLY_FIXED_LEN: usize = 68;
/// Offset of the reply's `msg_len: u16`.
const REPLY_MSG_LEN_AT: usize = 44;

/// `DEVLEND_FUZZ_SHOW=1`: print what each input decodes to (to read a reproducer).
static SHOW: LazyLock<bool> = LazyLock::new(|| std::env::var_os("DEVLEND_FUZZ_SHOW").is_some());

static SIGNER: LazyLock<TokenSigner> = LazyLock::new(|| TokenSigner::from_seed(SEED));
static KEY: LazyLock<PublicKey> = LazyLock::new(|| SIGNER.public_key());
static RAW_KEY: LazyLock<SigningKey> = LazyLock::new(|| SigningKey::from_bytes(&SEED));

fuzz_target!(|data: &[u8]| {
    let Some((&which, data)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => request_header(data),
        1 => response_header(data),
        2 => hello(data),
        3 => hello_reply(data),
        4 => token_text(data),
        _ => signed_token(data),
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
    let mut rest = data;
    let r = HelloReply::read_from(&mut rest);
    show(&r);
    if let Ok(r) = r {
        let wire = consumed(data, rest);
        let mut out = Vec::new();
        r.write_to(&mut out).expect("a decoded reply encodes");
        // The message is decoded lossily (it is only shown to people): only a UTF-8
        // message has its bytes back.
        // With a credit, its 8 bytes come before the message.
        let msg_at = REPLY_FIXED_LEN + if r.credit.is_some() { 8 } else { 0 };
        if std::str::from_utf8(&wire[msg_at..]).is_ok() {
            assert_eq!(out, wire, "{r:?} does not re-encode");
        } else {
            // Everything but the message and its length is still the same.
            assert_eq!(out[..REPLY_MSG_LEN_AT], wire[..REPLY_MSG_LEN_AT]);
            assert_eq!(
                out[REPLY_MSG_LEN_AT + 2..REPLY_FIXED_LEN],
                wire[REPLY_MSG_LEN_AT + 2..REPLY_FIXED_LEN]
            );
        }
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
