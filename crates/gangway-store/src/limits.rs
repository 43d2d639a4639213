//! How large one transaction may be, and how to split a batch of
//! independent writes into transactions that fit.
//!
//! etcd refuses a transaction with more than `--max-txn-ops` compares or
//! operations (default 128) or a request over `--max-request-bytes`
//! (default 1.5 MiB). Gangway runs on an unmodified etcd by writing large
//! batches (a group commit of submissions, a scheduling cycle's decisions)
//! as several transactions, each of whole items (a job with its idempotency
//! key stays in one), each carrying the leader's fence.

use std::ops::Range;

/// Limits of one transaction, in the store's own terms.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnLimits {
    /// Compares per transaction ([`crate::Compare`]s; the store's own fence
    /// compare is already accounted for).
    pub max_compares: usize,
    /// Operations (puts and deletes) per transaction.
    pub max_ops: usize,
    /// Bytes of keys and values per transaction.
    pub max_bytes: usize,
}

impl TxnLimits {
    /// No limit (the embedded store writes any batch in one transaction).
    pub const UNLIMITED: TxnLimits = TxnLimits {
        max_compares: usize::MAX,
        max_ops: usize::MAX,
        max_bytes: usize::MAX,
    };

    /// etcd with its default flags: 128 compares and 128 operations per
    /// transaction, 1.5 MiB per request. A store compare on revision 0 is
    /// two etcd compares and the fence one more, so 63 store compares;
    /// 1 MiB of keys and values leaves room for the compares' keys and the
    /// request's framing.
    pub const ETCD_DEFAULT: TxnLimits = TxnLimits {
        max_compares: 63,
        max_ops: 128,
        max_bytes: 1 << 20,
    };

    /// Splits items, each needing `(compares, ops, bytes)`, into consecutive
    /// ranges whose sums stay within the limits once `fixed` (what every
    /// transaction adds, such as a sequence counter) is added. An item that
    /// alone exceeds a limit gets a range of its own (the store then says
    /// why it refuses it).
    pub fn split(
        &self,
        fixed: (usize, usize, usize),
        items: impl IntoIterator<Item = (usize, usize, usize)>,
    ) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut start = 0;
        let mut sum = fixed;
        let mut n = 0;
        for (i, (c, o, b)) in items.into_iter().enumerate() {
            n = i + 1;
            let next = (
                sum.0.saturating_add(c),
                sum.1.saturating_add(o),
                sum.2.saturating_add(b),
            );
            let fits =
                next.0 <= self.max_compares && next.1 <= self.max_ops && next.2 <= self.max_bytes;
            if fits || i == start {
                sum = next;
            } else {
                out.push(start..i);
                start = i;
                sum = (
                    fixed.0.saturating_add(c),
                    fixed.1.saturating_add(o),
                    fixed.2.saturating_add(b),
                );
            }
        }
        if n > start {
            out.push(start..n);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_is_one_range() {
        let r = TxnLimits::UNLIMITED.split((1, 1, 0), vec![(2, 2, 100); 5000]);
        assert_eq!(r, vec![0..5000]);
    }

    #[test]
    fn etcd_defaults_split_into_fitting_whole_items() {
        let l = TxnLimits::ETCD_DEFAULT;
        let items: Vec<_> = (0..1000).map(|i| (2, 2, 100 + i % 7)).collect();
        let r = l.split((1, 1, 16), items.clone());
        // Every item is in exactly one range, in order.
        let mut next = 0;
        for range in &r {
            assert_eq!(range.start, next);
            next = range.end;
            let s = items[range.clone()]
                .iter()
                .fold((1, 1, 16), |a, x| (a.0 + x.0, a.1 + x.1, a.2 + x.2));
            assert!(s.0 <= l.max_compares && s.1 <= l.max_ops && s.2 <= l.max_bytes);
        }
        assert_eq!(next, 1000);
        // 31 items of 2 compares fit beside the fixed one (63).
        assert_eq!(r[0], 0..31);
    }

    #[test]
    fn bytes_split_and_an_oversized_item_stands_alone() {
        let l = TxnLimits {
            max_compares: 100,
            max_ops: 100,
            max_bytes: 1000,
        };
        let r = l.split(
            (0, 0, 0),
            [
                (1, 1, 400),
                (1, 1, 400),
                (1, 1, 400),
                (1, 1, 5000),
                (1, 1, 10),
            ],
        );
        assert_eq!(r, vec![0..2, 2..3, 3..4, 4..5]);
        assert!(l.split((0, 0, 0), Vec::new()).is_empty());
    }
}
