//! Message headers: ordered, multi-valued, with case-insensitive names.

use std::fmt;
use std::sync::Arc;

use compact_str::CompactString;
use smallvec::SmallVec;

/// Message headers.
///
/// Names compare ASCII case-insensitively (`Reply-To` and `reply-to` are the same
/// header) and keep the spelling they were added with. A name may carry several
/// values, kept in insertion order. Headers are a small vector: an empty set
/// does not allocate, and the handful of headers a message usually carries are
/// faster to scan than to hash.
///
/// The vector is shared copy-on-write: cloning headers (every message sent
/// with the same [`crate::DeliveryOptions`] does) is one reference-count
/// increment, not a copy of every string.
///
/// Stored as one block: up to two pairs inline in the shared vector, and
/// names and values of up to 24 bytes inline in their pair (`smallvec`,
/// `compact_str`). Headers built from borrowed pairs (`From<&[(&str,
/// &str)]>`, what a cluster link does for every message it reads) then take
/// one allocation for a header or two instead of four (vector, shared cell,
/// name, value). [`add`](Self::add) takes `String`s, so a hand-built set
/// still allocates one per string before it is stored inline.
#[derive(Clone, Default)]
pub struct Headers {
    entries: Option<Arc<Entries>>,
}

type Entries = SmallVec<[(CompactString, CompactString); 2]>;

static NO_ENTRIES: Entries = SmallVec::new_const();

impl Headers {
    /// An empty set of headers.
    pub const fn new() -> Self {
        Self { entries: None }
    }

    fn entries(&self) -> &Entries {
        self.entries.as_deref().unwrap_or(&NO_ENTRIES)
    }

    fn entries_mut(&mut self) -> &mut Entries {
        Arc::make_mut(self.entries.get_or_insert_with(Default::default))
    }

    /// Adds a value, keeping values already present under that name.
    pub fn add(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        self.entries_mut()
            .push((name.into().into(), value.into().into()));
        self
    }

    /// Replaces every value of `name` with `value`.
    pub fn set(&mut self, name: impl Into<String>, value: impl Into<String>) -> &mut Self {
        let name = name.into();
        self.remove(&name);
        self.entries_mut().push((name.into(), value.into().into()));
        self
    }

    /// The first value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.entries()
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Every value of `name`, in insertion order.
    pub fn get_all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.entries()
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether `name` has at least one value.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Removes every value of `name`; returns how many were removed.
    pub fn remove(&mut self, name: &str) -> usize {
        if !self.contains(name) {
            return 0;
        }
        let entries = self.entries_mut();
        let before = entries.len();
        entries.retain(|(n, _)| !n.eq_ignore_ascii_case(name));
        before - entries.len()
    }

    /// Number of (name, value) pairs.
    pub fn len(&self) -> usize {
        self.entries().len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.entries().is_empty()
    }

    /// All (name, value) pairs in insertion order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> {
        self.entries().iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

impl PartialEq for Headers {
    fn eq(&self, other: &Self) -> bool {
        self.entries() == other.entries()
    }
}

impl Eq for Headers {}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Headers {
    /// Headers holding `pairs` in order, built in one go (no copy-on-write
    /// check per header, no regrowth); none allocated when there are none.
    fn from_pairs(pairs: impl ExactSizeIterator<Item = (CompactString, CompactString)>) -> Self {
        Self {
            entries: (pairs.len() > 0).then(|| Arc::new(pairs.collect())),
        }
    }
}

/// Headers from (name, value) pairs in order, each converted to the inline
/// form (a short name or value is copied inline and its `String` freed).
impl From<Vec<(String, String)>> for Headers {
    fn from(entries: Vec<(String, String)>) -> Self {
        Self::from_pairs(entries.into_iter().map(|(n, v)| (n.into(), v.into())))
    }
}

/// Headers copied from borrowed (name, value) pairs in order, in one go:
/// for a decoder reading them out of a frame (no `String` per name and
/// value).
impl From<&[(&str, &str)]> for Headers {
    fn from(pairs: &[(&str, &str)]) -> Self {
        Self::from_pairs(pairs.iter().map(|&(n, v)| (n.into(), v.into())))
    }
}

impl<N: Into<String>, V: Into<String>> FromIterator<(N, V)> for Headers {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        let mut h = Headers::new();
        for (n, v) in iter {
            h.add(n, v);
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_from_a_vector_keep_its_order_and_an_empty_one_allocates_nothing() {
        let empty = Headers::from(Vec::new());
        assert!(empty.entries.is_none() && empty == Headers::new());
        let h = Headers::from(vec![
            ("Reply-To".to_owned(), "a".to_owned()),
            ("x".to_owned(), "1".to_owned()),
            ("reply-to".to_owned(), "b".to_owned()),
        ]);
        assert_eq!(h.get_all("REPLY-TO").collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(h.len(), 3);
        let mut added = Headers::new();
        added
            .add("Reply-To", "a")
            .add("x", "1")
            .add("reply-to", "b");
        assert_eq!(h, added);
    }

    #[test]
    fn headers_from_borrowed_pairs_equal_added_ones_short_long_and_many() {
        let long = "a value well past the twenty-four bytes kept inline".repeat(3);
        let pairs: Vec<(&str, &str)> = vec![
            ("Reply-To", "echo.reply.0.12"),
            ("x", long.as_str()),
            ("reply-to", "b"),
            ("é-name", ""),
        ];
        for n in 0..=pairs.len() {
            let h = Headers::from(&pairs[..n]);
            let mut added = Headers::new();
            for (k, v) in &pairs[..n] {
                added.add(*k, *v);
            }
            assert_eq!(h, added, "{n} pairs");
            assert_eq!(h.iter().collect::<Vec<_>>(), pairs[..n], "{n} pairs");
            assert_eq!(h.entries.is_none(), n == 0);
        }
        let h = Headers::from(&pairs[..]);
        assert_eq!(
            h.get_all("REPLY-TO").collect::<Vec<_>>(),
            ["echo.reply.0.12", "b"]
        );
        assert_eq!(h.get("X"), Some(long.as_str()));
        // Copy on write still: a clone changed leaves the original as it was.
        let mut c = h.clone();
        c.set("x", "short");
        assert_eq!(h.get("x"), Some(long.as_str()));
        assert_eq!(c.get("x"), Some("short"));
    }

    #[test]
    fn names_are_case_insensitive_and_multi_valued() {
        let mut h = Headers::new();
        h.add("Accept", "a").add("accept", "b").add("X-Other", "c");
        assert_eq!(h.get("ACCEPT"), Some("a"));
        assert_eq!(h.get_all("accept").collect::<Vec<_>>(), ["a", "b"]);
        h.set("ACCEPT", "z");
        assert_eq!(h.get_all("Accept").collect::<Vec<_>>(), ["z"]);
        assert_eq!(h.remove("x-other"), 1);
        assert!(!h.contains("X-Other"));
        assert_eq!(h.len(), 1);
    }
}
