//! A request's id on the wire: `(sequence << 16) | head`. The queue's table is indexed
//! by head (a head cannot be in flight twice), nothing is allocated per request, and the
//! sequence part grows with every request, so ids sort in submission order. A response
//! names its request's head by its id.

/// The id of a queue's `seq`th request, made from the chain at head `head`.
pub(crate) fn request_id(seq: u64, head: u16) -> u64 {
    (seq << 16) | u64::from(head)
}

/// The head of the chain whose request has id `id`.
pub(crate) fn head_of(id: u64) -> u16 {
    (id & 0xffff) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_its_head_and_later_requests_sort_after() {
        let a = request_id(1, 0xffff);
        let b = request_id(2, 0);
        assert_eq!((head_of(a), head_of(b)), (0xffff, 0));
        assert!(a < b, "ids sort in submission order, whatever the heads");
        assert_ne!(
            request_id(3, 7),
            request_id(4, 7),
            "a head's next request is told apart"
        );
    }
}
