//! Permission lists compiled once: exact addresses in a hash set, regexes
//! anchored so they match whole addresses (Java's `Matcher.matches`).

use std::collections::HashSet;

use regex::Regex;

use crate::{ConfigError, PermittedOptions};

/// A compiled permission list. Empty denies everything.
#[derive(Debug, Clone, Default)]
pub(crate) struct Permissions {
    exact: HashSet<String>,
    regexes: Vec<Regex>,
    /// An entry with neither an address nor a regex permits everything.
    any: bool,
}

impl Permissions {
    pub(crate) fn compile(
        list: &[PermittedOptions],
        which: &'static str,
    ) -> Result<Self, ConfigError> {
        let mut p = Permissions::default();
        for entry in list {
            match (&entry.address, &entry.address_regex) {
                (Some(a), _) => {
                    p.exact.insert(a.clone());
                }
                (None, Some(r)) => {
                    let anchored = format!("^(?:{r})$");
                    let re = Regex::new(&anchored).map_err(|e| ConfigError::BadRegex {
                        list: which,
                        regex: r.clone(),
                        reason: e.to_string(),
                    })?;
                    p.regexes.push(re);
                }
                (None, None) => p.any = true,
            }
        }
        Ok(p)
    }

    pub(crate) fn allows(&self, address: &str) -> bool {
        self.any || self.exact.contains(address) || self.regexes.iter().any(|r| r.is_match(address))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_regex_any_and_empty() {
        let p = Permissions::compile(
            &[
                PermittedOptions::address("a.b"),
                PermittedOptions::regex("news\\.[a-z]+"),
            ],
            "inbound_permitted",
        )
        .unwrap();
        assert!(p.allows("a.b"));
        assert!(!p.allows("a.bc"));
        assert!(p.allows("news.sport"));
        assert!(
            !p.allows("news.sport.x"),
            "regex must match the whole address"
        );
        assert!(!p.allows("xnews.sport"));
        assert!(!Permissions::compile(&[], "x").unwrap().allows("a.b"));
        assert!(Permissions::compile(&[PermittedOptions::default()], "x")
            .unwrap()
            .allows("z"));
        assert!(Permissions::compile(&[PermittedOptions::regex("(")], "x").is_err());
    }
}
