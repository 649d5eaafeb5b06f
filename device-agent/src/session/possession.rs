//! The lender's side of proof of possession ([`devlend_fabric::holder_proof`]), shared
//! by every transport: the interim reply to a hello that asks to prove possession (this
//! lender's proof of the hello's challenge, and a fresh nonce), and what the borrower's
//! [`Possession`] adds to the hello (its token, and its signature under that nonce),
//! which [`crate::leases::LeaseGuard`] then checks with the token's holder key.

use devlend_fabric::holder_proof::{self, Held, Possession, NONCE_LEN};
use devlend_fabric::{Hello, HelloReply};

use crate::server::shared::LenderState;

/// The interim reply to `hello` and the nonce in it; `None` when the system has no
/// randomness (the handshake then ends: a nonce that could repeat would let a captured
/// proof be replayed).
pub(crate) fn interim(
    shared: &LenderState,
    hello: &Hello,
) -> Option<(HelloReply, [u8; NONCE_LEN])> {
    let nonce = holder_proof::nonce().ok()?;
    Some((HelloReply::prove(shared.proof(hello), nonce), nonce))
}

/// Takes the borrower's `possession` into `hello`, as received after the interim reply
/// that carried `nonce`.
pub(crate) fn take(hello: &mut Hello, nonce: [u8; NONCE_LEN], possession: Possession) {
    hello.token = possession.token;
    hello.held = Some(Held {
        nonce,
        signature: possession.signature,
    });
}
