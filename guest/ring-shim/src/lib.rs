//! A stand-in for [ring](https://docs.rs/ring) in the plugins' workspace:
//! exactly the part of its API that parquet's `encryption` module names
//! (AES-GCM with 128- and 256-bit keys, a nonce sequence, the system's
//! randomness), implemented with RustCrypto's `aes-gcm` and `getrandom`.
//!
//! Why: iceberg turns parquet's `encryption` feature on, which brings ring,
//! whose C needs clang and a wasm sysroot to build for a plugin. Sluice
//! never encrypts Parquet files, but the code must build; with this crate in
//! ring's place it builds from Rust alone.
//!
//! Invariants: the same contract as ring's: `seal` and `open` are AES-GCM
//! with a 12-byte nonce and a 16-byte tag appended after the ciphertext, and
//! any failure is the opaque [`error::Unspecified`].

pub mod error {
    /// ring's only error: something failed, on purpose without detail.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Unspecified;

    impl std::fmt::Display for Unspecified {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("ring::error::Unspecified")
        }
    }

    impl std::error::Error for Unspecified {}
}

pub mod rand {
    use crate::error::Unspecified;

    /// A source of cryptographically secure random bytes.
    pub trait SecureRandom {
        fn fill(&self, dest: &mut [u8]) -> Result<(), Unspecified>;
    }

    /// The operating system's randomness (`wasi:random` inside a plugin).
    #[derive(Debug, Clone, Default)]
    pub struct SystemRandom;

    impl SystemRandom {
        pub fn new() -> Self {
            Self
        }
    }

    impl SecureRandom for SystemRandom {
        fn fill(&self, dest: &mut [u8]) -> Result<(), Unspecified> {
            getrandom::fill(dest).map_err(|_| Unspecified)
        }
    }
}

pub mod aead {
    use aes_gcm::aead::AeadInPlace;
    use aes_gcm::{Aes128Gcm, Aes256Gcm, KeyInit};

    use crate::error::Unspecified;

    pub const NONCE_LEN: usize = 12;
    pub const MAX_TAG_LEN: usize = 16;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Id {
        Aes128Gcm,
        Aes256Gcm,
    }

    /// An AEAD algorithm.
    #[derive(Debug, PartialEq, Eq)]
    pub struct Algorithm {
        id: Id,
        key_len: usize,
    }

    impl Algorithm {
        pub fn key_len(&self) -> usize {
            self.key_len
        }

        pub fn tag_len(&self) -> usize {
            MAX_TAG_LEN
        }

        pub fn nonce_len(&self) -> usize {
            NONCE_LEN
        }
    }

    pub static AES_128_GCM: Algorithm = Algorithm { id: Id::Aes128Gcm, key_len: 16 };
    pub static AES_256_GCM: Algorithm = Algorithm { id: Id::Aes256Gcm, key_len: 32 };

    /// A nonce the caller promises to use once per key.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Nonce([u8; NONCE_LEN]);

    impl Nonce {
        pub fn try_assume_unique_for_key(value: &[u8]) -> Result<Self, Unspecified> {
            value.try_into().map(Self).map_err(|_| Unspecified)
        }

        pub fn assume_unique_for_key(value: [u8; NONCE_LEN]) -> Self {
            Self(value)
        }
    }

    impl AsRef<[u8; NONCE_LEN]> for Nonce {
        fn as_ref(&self) -> &[u8; NONCE_LEN] {
            &self.0
        }
    }

    /// Nonces, one after another.
    pub trait NonceSequence {
        fn advance(&mut self) -> Result<Nonce, Unspecified>;
    }

    /// Additional authenticated data.
    #[derive(Debug, Clone, Copy)]
    pub struct Aad<A>(A);

    impl<A: AsRef<[u8]>> Aad<A> {
        pub fn from(aad: A) -> Self {
            Self(aad)
        }
    }

    impl Aad<[u8; 0]> {
        pub fn empty() -> Self {
            Self([])
        }
    }

    impl<A: AsRef<[u8]>> AsRef<[u8]> for Aad<A> {
        fn as_ref(&self) -> &[u8] {
            self.0.as_ref()
        }
    }

    /// An authentication tag.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Tag([u8; MAX_TAG_LEN]);

    impl AsRef<[u8]> for Tag {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    /// Key bytes checked against their algorithm.
    #[derive(Clone)]
    pub struct UnboundKey {
        algorithm: &'static Algorithm,
        cipher: Cipher,
    }

    #[derive(Clone)]
    enum Cipher {
        Aes128(Box<Aes128Gcm>),
        Aes256(Box<Aes256Gcm>),
    }

    impl UnboundKey {
        pub fn new(algorithm: &'static Algorithm, key_bytes: &[u8]) -> Result<Self, Unspecified> {
            let cipher = match algorithm.id {
                Id::Aes128Gcm => {
                    Cipher::Aes128(Box::new(Aes128Gcm::new_from_slice(key_bytes).map_err(|_| Unspecified)?))
                }
                Id::Aes256Gcm => {
                    Cipher::Aes256(Box::new(Aes256Gcm::new_from_slice(key_bytes).map_err(|_| Unspecified)?))
                }
            };
            Ok(Self { algorithm, cipher })
        }

        pub fn algorithm(&self) -> &'static Algorithm {
            self.algorithm
        }
    }

    impl std::fmt::Debug for UnboundKey {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            // Never the key.
            f.debug_struct("UnboundKey").field("algorithm", &self.algorithm).finish()
        }
    }

    /// A key used with caller-managed nonces.
    #[derive(Debug, Clone)]
    pub struct LessSafeKey(UnboundKey);

    impl LessSafeKey {
        pub fn new(key: UnboundKey) -> Self {
            Self(key)
        }

        pub fn algorithm(&self) -> &'static Algorithm {
            self.0.algorithm
        }

        /// Encrypts `in_out` in place and returns the tag.
        pub fn seal_in_place_separate_tag<A: AsRef<[u8]>>(
            &self,
            nonce: Nonce,
            aad: Aad<A>,
            in_out: &mut [u8],
        ) -> Result<Tag, Unspecified> {
            let nonce = aes_gcm::Nonce::from_slice(&nonce.0);
            let tag = match &self.0.cipher {
                Cipher::Aes128(c) => c.encrypt_in_place_detached(nonce, aad.as_ref(), in_out),
                Cipher::Aes256(c) => c.encrypt_in_place_detached(nonce, aad.as_ref(), in_out),
            }
            .map_err(|_| Unspecified)?;
            let mut out = [0u8; MAX_TAG_LEN];
            out.copy_from_slice(&tag);
            Ok(Tag(out))
        }

        /// Decrypts `in_out` (ciphertext followed by its tag) in place and
        /// returns the plaintext part of it.
        pub fn open_in_place<'in_out, A: AsRef<[u8]>>(
            &self,
            nonce: Nonce,
            aad: Aad<A>,
            in_out: &'in_out mut [u8],
        ) -> Result<&'in_out mut [u8], Unspecified> {
            let split = in_out.len().checked_sub(MAX_TAG_LEN).ok_or(Unspecified)?;
            let (text, tag) = in_out.split_at_mut(split);
            let nonce = aes_gcm::Nonce::from_slice(&nonce.0);
            let tag = aes_gcm::Tag::from_slice(tag);
            match &self.0.cipher {
                Cipher::Aes128(c) => c.decrypt_in_place_detached(nonce, aad.as_ref(), text, tag),
                Cipher::Aes256(c) => c.decrypt_in_place_detached(nonce, aad.as_ref(), text, tag),
            }
            .map_err(|_| Unspecified)?;
            Ok(&mut in_out[..split])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::aead::*;
    use super::rand::{SecureRandom, SystemRandom};

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
    }

    /// The AES-GCM test vector of NIST SP 800-38D (McGrew & Viega, test case 4).
    #[test]
    fn seals_and_opens_like_aes_gcm() {
        let key = hex("feffe9928665731c6d6a8f9467308308");
        let nonce = hex("cafebabefacedbaddecaf888");
        let aad = hex("feedfacedeadbeeffeedfacedeadbeefabaddad2");
        let plain = hex(
            "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532fcf0e2449a6b525b16aedf5aa0de657ba637b39",
        );
        let key = LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &key).expect("key"));
        let mut data = plain.clone();
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::try_assume_unique_for_key(&nonce).expect("nonce"),
                Aad::from(&aad),
                &mut data,
            )
            .expect("seal");
        assert_eq!(tag.as_ref(), hex("5bc94fbc3221a5db94fae95ae7121a47").as_slice());
        assert_eq!(
            data,
            hex(
                "42831ec2217774244b7221b784d0d49ce3aa212f2c02a4e035c17e2329aca12e21d514b25466931c7d8f6a5aac84aa051ba30b396a0aac973d58e091"
            )
        );
        data.extend_from_slice(tag.as_ref());
        let opened = key
            .open_in_place(Nonce::try_assume_unique_for_key(&nonce).expect("nonce"), Aad::from(&aad), &mut data)
            .expect("open");
        assert_eq!(opened, plain.as_slice());
        // A flipped bit is refused.
        data[0] ^= 1;
        assert!(key.open_in_place(Nonce::assume_unique_for_key([0; 12]), Aad::from(&aad), &mut data).is_err());
        assert!(UnboundKey::new(&AES_256_GCM, &[0; 16]).is_err(), "a 256-bit algorithm needs 32 key bytes");
        let mut random = [0u8; 32];
        SystemRandom::new().fill(&mut random).expect("randomness");
        assert_ne!(random, [0u8; 32]);
    }
}
