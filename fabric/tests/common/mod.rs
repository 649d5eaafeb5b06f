//! What the golden-vector tests share: hex decoding, the byte comparison, and the round
//! trip of a hello and a hello reply through their bytes.

use devlend_fabric::{Hello, HelloReply};

pub fn unhex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2));
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

pub fn same(name: &str, got: &[u8], golden: &str) {
    let want = unhex(golden);
    assert_eq!(
        got,
        want.as_slice(),
        "{name}: the bytes on the wire changed"
    );
}

pub fn hello_round_trip(name: &str, h: &Hello, golden: &str) {
    let mut b = Vec::new();
    h.write_to(&mut b).unwrap();
    same(name, &b, golden);
    assert_eq!(&Hello::read_from(&mut b.as_slice()).unwrap(), h, "{name}");
}

pub fn reply_round_trip(name: &str, r: &HelloReply, golden: &str) {
    let mut b = Vec::new();
    r.write_to(&mut b).unwrap();
    same(name, &b, golden);
    assert_eq!(
        &HelloReply::read_from(&mut b.as_slice()).unwrap(),
        r,
        "{name}"
    );
}
