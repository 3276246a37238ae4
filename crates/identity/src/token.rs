//! Bootstrap tokens: proof that a workload may ask for one identity.
//!
//! In local mode a token is `tether-v1:<identity>:<hex HMAC-SHA256 of the
//! identity>` under a secret kept beside the issuer (`token.key`), so the
//! control plane needs no table of tokens and `tether up` (or an operator,
//! with `tether identity token`) can mint one per workload.

use std::path::Path;

use ring::hmac;

const PREFIX: &str = "tether-v1:";
pub const TOKEN_KEY: &str = "token.key";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("token is empty")]
    Empty,
    #[error("token is not in the form tether-v1:<identity>:<mac>")]
    Malformed,
    #[error("token signature does not match (token for another mesh, or altered)")]
    BadSignature,
}

/// Checks a Certify request's token and says which identity it allows.
pub trait TokenValidator: Send + Sync + 'static {
    fn validate(&self, token: &[u8]) -> Result<String, TokenError>;
}

pub struct LocalTokens {
    key: hmac::Key,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

impl LocalTokens {
    pub fn from_secret(secret: &[u8]) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        }
    }

    /// Loads the secret from `dir/token.key` (hex).
    pub fn load(dir: &Path) -> std::io::Result<Self> {
        let path = dir.join(TOKEN_KEY);
        let text = std::fs::read_to_string(&path)?;
        let secret = unhex(text.trim()).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: not a hex secret", path.display()),
            )
        })?;
        Ok(Self::from_secret(&secret))
    }

    /// A new random secret, hex-encoded, for `token.key`.
    pub fn new_secret() -> String {
        let mut secret = [0u8; 32];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
            .expect("the system random source works");
        hex(&secret)
    }

    pub fn issue(&self, identity: &str) -> String {
        let tag = hmac::sign(&self.key, identity.as_bytes());
        format!("{PREFIX}{identity}:{}", hex(tag.as_ref()))
    }
}

impl TokenValidator for LocalTokens {
    fn validate(&self, token: &[u8]) -> Result<String, TokenError> {
        if token.is_empty() {
            return Err(TokenError::Empty);
        }
        let token = std::str::from_utf8(token)
            .map_err(|_| TokenError::Malformed)?
            .trim();
        let rest = token.strip_prefix(PREFIX).ok_or(TokenError::Malformed)?;
        let (identity, mac) = rest.rsplit_once(':').ok_or(TokenError::Malformed)?;
        let mac = unhex(mac).ok_or(TokenError::Malformed)?;
        if identity.is_empty() {
            return Err(TokenError::Malformed);
        }
        hmac::verify(&self.key, identity.as_bytes(), &mac).map_err(|_| TokenError::BadSignature)?;
        Ok(identity.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_allow_exactly_their_identity() {
        let tokens = LocalTokens::from_secret(b"secret");
        let t = tokens.issue("web.demo.serviceaccount.identity.cluster.local");
        assert_eq!(
            tokens.validate(t.as_bytes()).unwrap(),
            "web.demo.serviceaccount.identity.cluster.local"
        );
        let forged = t.replace("web.demo", "db.demo");
        assert_eq!(
            tokens.validate(forged.as_bytes()),
            Err(TokenError::BadSignature)
        );
        let other_mesh = LocalTokens::from_secret(b"other");
        assert_eq!(
            other_mesh.validate(t.as_bytes()),
            Err(TokenError::BadSignature)
        );
        assert_eq!(tokens.validate(b""), Err(TokenError::Empty));
        assert_eq!(tokens.validate(b"hello"), Err(TokenError::Malformed));
        assert_eq!(
            tokens.validate(b"tether-v1:x:zz"),
            Err(TokenError::Malformed)
        );
    }

    #[test]
    fn secrets_round_trip_through_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(TOKEN_KEY), LocalTokens::new_secret()).unwrap();
        let tokens = LocalTokens::load(dir.path()).unwrap();
        let t = tokens.issue("a.b");
        assert_eq!(
            LocalTokens::load(dir.path())
                .unwrap()
                .validate(t.as_bytes())
                .unwrap(),
            "a.b"
        );
    }
}
