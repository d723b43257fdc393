//! Key slots: CRC16/XMODEM of the key (or of its `{hash tag}`) mod 16384.
//!
//! Hand-written: it is twenty lines, on the hot path of every command, and a
//! table-driven CRC needs no dependency.

/// The number of hash slots in a Redis Cluster.
pub const SLOTS: usize = 16384;

const fn crc16_table() -> [u16; 256] {
    let mut t = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut j = 0;
        while j < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            j += 1;
        }
        t[i] = crc;
        i += 1;
    }
    t
}

static CRC16: [u16; 256] = crc16_table();

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), as Redis Cluster uses.
pub fn crc16(data: &[u8]) -> u16 {
    data.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16[usize::from(((crc >> 8) as u8) ^ b)]
    })
}

/// The part of `key` that is hashed: the text between the first `{` and the
/// next `}` if that is non-empty, else the whole key.
pub fn hash_tag(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        if let Some(len) = key[open + 1..].iter().position(|&b| b == b'}') {
            if len > 0 {
                return &key[open + 1..open + 1 + len];
            }
        }
    }
    key
}

/// The slot `key` belongs to.
pub fn key_slot(key: &[u8]) -> u16 {
    crc16(hash_tag(key)) & (SLOTS as u16 - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc16_matches_the_reference_check_value() {
        // The CRC catalogue's check value for CRC-16/XMODEM; also the example
        // in the Redis Cluster specification.
        assert_eq!(crc16(b"123456789"), 0x31C3);
    }

    #[test]
    fn slots_match_known_vectors() {
        // Values as reported by `CLUSTER KEYSLOT` on Redis 7.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"hello"), 866);
        assert_eq!(key_slot(b"test"), 6918);
        assert_eq!(key_slot(b""), 0);
    }

    #[test]
    fn hash_tags_follow_the_specification() {
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"{user1000}.followers"), key_slot(b"user1000"));
        // Only the first {...} counts.
        assert_eq!(hash_tag(b"foo{bar}{zap}"), b"bar");
        // Empty tag: the whole key is hashed.
        assert_eq!(hash_tag(b"foo{}{bar}"), b"foo{}{bar}");
        assert_eq!(hash_tag(b"foo{{bar}}zap"), b"{bar");
        assert_eq!(hash_tag(b"foo{bar"), b"foo{bar");
    }
}
