//! A fixed-size bitset over node indices, used for the free-GPU index and for
//! masking out reserved nodes. Cloning it is a memcpy, which keeps a
//! scheduling session's private copy of the index cheap.

/// Bitset over `0..len`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Bitset {
    words: Vec<u64>,
}

impl Bitset {
    /// An empty set able to hold `0..len`.
    pub fn new(len: usize) -> Self {
        Bitset {
            words: vec![0; len.div_ceil(64)],
        }
    }

    /// Grows the set to hold `0..len`.
    pub fn grow(&mut self, len: usize) {
        let need = len.div_ceil(64);
        if self.words.len() < need {
            self.words.resize(need, 0);
        }
    }

    /// Adds `i`.
    pub fn insert(&mut self, i: usize) {
        self.words[i / 64] |= 1 << (i % 64);
    }

    /// Removes `i`.
    pub fn remove(&mut self, i: usize) {
        if let Some(w) = self.words.get_mut(i / 64) {
            *w &= !(1 << (i % 64));
        }
    }

    /// Whether `i` is in the set.
    pub fn contains(&self, i: usize) -> bool {
        self.words
            .get(i / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }

    /// Members in ascending order that are not in `exclude`.
    pub fn iter_excluding<'a>(
        &'a self,
        exclude: Option<&'a Bitset>,
    ) -> impl Iterator<Item = usize> + 'a {
        self.words.iter().enumerate().flat_map(move |(wi, &w)| {
            let ex = exclude.and_then(|e| e.words.get(wi)).copied().unwrap_or(0);
            let mut bits = w & !ex;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                Some(wi * 64 + b)
            })
        })
    }

    /// Members in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        self.iter_excluding(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_iterate() {
        let mut b = Bitset::new(200);
        for i in [0, 63, 64, 130, 199] {
            b.insert(i);
        }
        b.remove(64);
        assert_eq!(b.iter().collect::<Vec<_>>(), vec![0, 63, 130, 199]);
        let mut ex = Bitset::new(200);
        ex.insert(130);
        assert_eq!(
            b.iter_excluding(Some(&ex)).collect::<Vec<_>>(),
            vec![0, 63, 199]
        );
        assert!(b.contains(199) && !b.contains(64) && !b.contains(10_000));
        assert!(!b.is_empty());
    }
}
