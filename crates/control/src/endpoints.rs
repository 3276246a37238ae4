//! Endpoint collections that share their parts between versions, so a
//! change to a few endpoints of a large service costs those endpoints, not
//! the service.
//!
//! - [`EndpointList`]: a service's endpoints in the registry's order, as a
//!   list of shared parts (the file registry makes one part per file). Two
//!   versions that share a part need not look inside it to compare.
//! - [`EndpointSet`]: what a subscriber of one (service, port) is sent,
//!   ordered by address, in shared chunks of at most [`CHUNK_MAX`]. A
//!   change copies the chunks it touches; comparing two versions skips the
//!   chunks they share. Subscribers keep the version they were sent, so
//!   every one of them costs a pointer, not a copy.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use tether_core::registry::EndpointSpec;

use crate::index::EndpointMeta;

// === EndpointList ===

/// A service's endpoints in order, in shared parts.
#[derive(Clone, Default)]
pub struct EndpointList {
    parts: Vec<Arc<[EndpointSpec]>>,
    len: usize,
    /// Whether no two endpoints serve one port at one address (the file
    /// registry's merge ensures it): then a version can be derived from
    /// the previous one by what changed, address by address.
    distinct: bool,
}

impl EndpointList {
    /// Parts whose endpoints never serve one port at one address twice,
    /// which the caller guarantees (the file registry's merge).
    pub(crate) fn distinct_parts(parts: Vec<Arc<[EndpointSpec]>>) -> Self {
        Self::parts(parts, true)
    }

    /// Parts in order; `distinct` when no two endpoints of all of them
    /// serve one port at one address (which the caller knows: the file
    /// registry's merge, the Kubernetes registry's count of listings).
    pub(crate) fn parts(parts: Vec<Arc<[EndpointSpec]>>, distinct: bool) -> Self {
        let len = parts.iter().map(|p| p.len()).sum();
        Self {
            parts,
            len,
            distinct,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no two endpoints are known to serve one port at one
    /// address (a list that does not know says no).
    #[cfg(test)]
    pub(crate) fn is_distinct(&self) -> bool {
        self.distinct
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn iter(&self) -> impl Iterator<Item = &EndpointSpec> + '_ {
        self.parts.iter().flat_map(|p| p.iter())
    }

    /// The endpoints of the parts `ids` names ([`EndpointChanges::new_parts`]),
    /// in the list's order, without looking inside the others.
    pub(crate) fn endpoints_of_parts<'a>(
        &'a self,
        ids: &'a HashSet<usize>,
    ) -> impl Iterator<Item = &'a EndpointSpec> + 'a {
        self.parts
            .iter()
            .filter(|p| ids.contains(&part_id(p)))
            .flat_map(|p| p.iter())
    }

    /// What changed from `old` to `self`, when both are distinct and share
    /// their unchanged parts in the same order: the endpoints gone (or
    /// changed) and the endpoints new (or changed). Costs the parts that
    /// differ. `None` when that cannot be told part by part.
    pub(crate) fn changes_from(&self, old: &EndpointList) -> Option<EndpointChanges> {
        if !(self.distinct && old.distinct) {
            return None;
        }
        let ptr = part_id;
        let new_parts: HashSet<usize> = self.parts.iter().map(ptr).collect();
        let old_parts: HashSet<usize> = old.parts.iter().map(ptr).collect();
        // The parts both share must keep their order: the order decides
        // which listing of a workload's name comes first.
        let shared_new = self.parts.iter().map(ptr).filter(|p| old_parts.contains(p));
        let shared_old = old.parts.iter().map(ptr).filter(|p| new_parts.contains(p));
        if !shared_new.eq(shared_old) {
            return None;
        }
        type Key = (SocketAddr, Option<u16>);
        let mut gone: HashMap<Key, &EndpointSpec> = old
            .parts
            .iter()
            .filter(|p| !new_parts.contains(&ptr(p)))
            .flat_map(|p| p.iter())
            .map(|ep| ((ep.address, ep.port), ep))
            .collect();
        let mut changes = EndpointChanges {
            new_parts: new_parts.difference(&old_parts).copied().collect(),
            ..EndpointChanges::default()
        };
        let mut count = |name: &Option<Arc<str>>, gone: bool| {
            let Some(name) = name else { return };
            let listings = match changes.names.get_mut(name) {
                Some(listings) => listings,
                None => changes.names.entry(name.clone()).or_default(),
            };
            if gone {
                listings.gone += 1;
            } else {
                listings.new += 1;
            }
        };
        for ep in gone.values() {
            count(&ep.name, true);
        }
        for ep in self
            .parts
            .iter()
            .filter(|p| !old_parts.contains(&ptr(p)))
            .flat_map(|p| p.iter())
        {
            count(&ep.name, false);
            match gone.remove(&(ep.address, ep.port)) {
                Some(before) if before == ep => {}
                Some(before) => {
                    changes.removed.push(before.clone());
                    changes.added.push(ep.clone());
                }
                None => changes.added.push(ep.clone()),
            }
        }
        changes.removed.extend(gone.into_values().cloned());
        Some(changes)
    }
}

/// What changed between two versions of a distinct [`EndpointList`].
#[derive(Debug, Default)]
pub(crate) struct EndpointChanges {
    pub removed: Vec<EndpointSpec>,
    pub added: Vec<EndpointSpec>,
    /// The names listed by the parts that changed, old and new (an
    /// endpoint that moved unchanged included: it may move its name's
    /// first listing), and how often each part lists them. Only these
    /// names' workloads can have changed.
    pub names: HashMap<Arc<str>, NameListings>,
    /// The parts new in this version ([`part_id`]).
    pub new_parts: HashSet<usize>,
}

/// How often the parts a change dropped, and those it added, list a name.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NameListings {
    pub gone: u32,
    pub new: u32,
}

/// A part's identity while it is alive (two versions of a list share a
/// part by pointer).
fn part_id(part: &Arc<[EndpointSpec]>) -> usize {
    Arc::as_ptr(part) as *const EndpointSpec as usize
}

impl From<Vec<EndpointSpec>> for EndpointList {
    fn from(endpoints: Vec<EndpointSpec>) -> Self {
        let len = endpoints.len();
        Self {
            parts: if endpoints.is_empty() {
                Vec::new()
            } else {
                vec![endpoints.into()]
            },
            len,
            distinct: false,
        }
    }
}

impl FromIterator<EndpointSpec> for EndpointList {
    fn from_iter<I: IntoIterator<Item = EndpointSpec>>(iter: I) -> Self {
        iter.into_iter().collect::<Vec<_>>().into()
    }
}

impl<'a> IntoIterator for &'a EndpointList {
    type Item = &'a EndpointSpec;
    type IntoIter = std::iter::FlatMap<
        std::slice::Iter<'a, Arc<[EndpointSpec]>>,
        std::slice::Iter<'a, EndpointSpec>,
        fn(&'a Arc<[EndpointSpec]>) -> std::slice::Iter<'a, EndpointSpec>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.parts.iter().flat_map(|p| p.iter())
    }
}

impl std::ops::Index<usize> for EndpointList {
    type Output = EndpointSpec;

    fn index(&self, index: usize) -> &EndpointSpec {
        let mut i = index;
        for part in &self.parts {
            if i < part.len() {
                return &part[i];
            }
            i -= part.len();
        }
        panic!("endpoint {index} past the end of a list of {}", self.len)
    }
}

impl PartialEq for EndpointList {
    fn eq(&self, other: &Self) -> bool {
        let same_parts = self.parts.len() == other.parts.len()
            && self
                .parts
                .iter()
                .zip(&other.parts)
                .all(|(a, b)| Arc::ptr_eq(a, b));
        same_parts || (self.len == other.len && self.iter().eq(other.iter()))
    }
}

impl Eq for EndpointList {}

impl std::fmt::Debug for EndpointList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

// === EndpointSet ===

/// The most endpoints one chunk of an [`EndpointSet`] holds: a change
/// copies the chunks it touches, a comparison steps over shared ones.
pub const CHUNK_MAX: usize = 256;
/// A chunk a change leaves smaller than this joins its neighbour, so
/// churn does not leave the set in slivers.
const CHUNK_MIN: usize = CHUNK_MAX / 4;

type Entry = (SocketAddr, EndpointMeta);
type Chunk = Arc<Vec<Entry>>;

/// Endpoints by address, in shared chunks (none empty). A clone shares
/// everything; [`EndpointSet::ptr_eq`] tells two handles of one version.
#[derive(Clone, Default)]
pub struct EndpointSet {
    chunks: Arc<Vec<Chunk>>,
    len: usize,
}

/// One change to an [`EndpointSet`]: an endpoint in (or replaced), or an
/// address out.
pub enum SetChange {
    Insert(SocketAddr, EndpointMeta),
    Remove(SocketAddr),
}

impl SetChange {
    fn addr(&self) -> SocketAddr {
        match self {
            SetChange::Insert(a, _) | SetChange::Remove(a) => *a,
        }
    }
}

impl EndpointSet {
    /// Builds a set from entries sorted by address, each address once.
    fn from_sorted(entries: impl ExactSizeIterator<Item = Entry>) -> Self {
        let len = entries.len();
        let mut chunks = Vec::with_capacity(len.div_ceil(CHUNK_MAX / 2));
        let mut chunk = Vec::new();
        for entry in entries {
            if chunk.len() == CHUNK_MAX / 2 {
                chunks.push(Arc::new(std::mem::take(&mut chunk)));
            }
            if chunk.is_empty() {
                chunk.reserve_exact(CHUNK_MAX / 2);
            }
            chunk.push(entry);
        }
        if !chunk.is_empty() {
            chunks.push(Arc::new(chunk));
        }
        Self {
            chunks: Arc::new(chunks),
            len,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether both are handles of one version.
    pub fn ptr_eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.chunks, &other.chunks)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&SocketAddr, &EndpointMeta)> + '_ {
        self.chunks
            .iter()
            .flat_map(|c| c.iter().map(|(a, m)| (a, m)))
    }

    pub fn keys(&self) -> impl Iterator<Item = &SocketAddr> + '_ {
        self.iter().map(|(a, _)| a)
    }

    pub fn values(&self) -> impl Iterator<Item = &EndpointMeta> + '_ {
        self.iter().map(|(_, m)| m)
    }

    pub fn get(&self, addr: &SocketAddr) -> Option<&EndpointMeta> {
        // The first chunk whose last address is not below `addr`.
        let i = self
            .chunks
            .partition_point(|c| c.last().is_some_and(|(a, _)| a < addr));
        let chunk = self.chunks.get(i)?;
        let j = chunk.binary_search_by(|(a, _)| a.cmp(addr)).ok()?;
        Some(&chunk[j].1)
    }

    pub fn contains_key(&self, addr: &SocketAddr) -> bool {
        self.get(addr).is_some()
    }

    /// A new version with `changes` applied (for one address, an insert
    /// wins over a removal); it shares every chunk they do not touch.
    pub fn with_changes(&self, mut changes: Vec<SetChange>) -> Self {
        if changes.is_empty() {
            return self.clone();
        }
        changes.sort_by_key(|c| (c.addr(), matches!(c, SetChange::Insert(..))));
        let mut ops = changes.into_iter().peekable();
        let mut out: Vec<Chunk> = Vec::with_capacity(self.chunks.len() + 1);
        // A touched chunk left too small, waiting to join the next one.
        let mut carry: Vec<Entry> = Vec::new();
        let last = self.chunks.len().saturating_sub(1);
        for (i, chunk) in self.chunks.iter().enumerate() {
            let bound = self.chunks.get(i + 1).map(|next| next[0].0);
            let mut mine = Vec::new();
            while let Some(op) = ops.next_if(|op| bound.is_none_or(|b| op.addr() < b)) {
                mine.push(op);
            }
            if mine.is_empty() && carry.is_empty() {
                out.push(chunk.clone());
                continue;
            }
            let mut entries = std::mem::take(&mut carry);
            merge_into(&mut entries, chunk, mine);
            if entries.len() < CHUNK_MIN {
                if i < last {
                    carry = entries;
                    continue;
                }
                if let Some(prev) = out.pop() {
                    entries = prev.iter().cloned().chain(entries).collect();
                }
            }
            push_split(&mut out, entries);
        }
        if self.chunks.is_empty() {
            let mut entries = Vec::new();
            merge_into(&mut entries, &[], ops.collect());
            push_split(&mut out, entries);
        }
        let len = out.iter().map(|c| c.len()).sum();
        Self {
            chunks: Arc::new(out),
            len,
        }
    }

    /// What changed from `old` to `self`: the addresses gone, and the
    /// addresses of endpoints new or changed, each in address order. Steps
    /// over the chunks both share.
    pub fn changes_from(&self, old: &EndpointSet) -> (Vec<SocketAddr>, Vec<SocketAddr>) {
        let (mut removed, mut added) = (Vec::new(), Vec::new());
        walk(old, self, |step| {
            match step {
                Step::Old(a) => removed.push(a),
                Step::New(a) | Step::Changed(a) => added.push(a),
            }
            true
        });
        (removed, added)
    }
}

/// Appends `chunk`'s entries with `ops` applied to `entries` (whose
/// addresses all sort before them).
fn merge_into(entries: &mut Vec<Entry>, chunk: &[Entry], ops: Vec<SetChange>) {
    entries.reserve(chunk.len() + ops.len());
    let mut old = chunk.iter().peekable();
    let mut ops = ops.into_iter().peekable();
    loop {
        match (old.peek(), ops.peek()) {
            (None, None) => break,
            (Some(_), None) => entries.extend(old.by_ref().cloned()),
            (Some((a, _)), Some(op)) if *a < op.addr() => entries.extend(old.next().cloned()),
            (_, Some(op)) => {
                let addr = op.addr();
                if old.peek().is_some_and(|(a, _)| *a == addr) {
                    old.next();
                }
                // The last change to an address is what stands (sorted
                // removals first, so an insert wins).
                let mut last = None;
                while let Some(op) = ops.next_if(|op| op.addr() == addr) {
                    last = Some(op);
                }
                if let Some(SetChange::Insert(a, meta)) = last {
                    entries.push((a, meta));
                }
            }
        }
    }
}

/// Pushes `entries` as one chunk, or as halves of [`CHUNK_MAX`] if larger.
fn push_split(out: &mut Vec<Chunk>, entries: Vec<Entry>) {
    if entries.is_empty() {
        return;
    }
    if entries.len() <= CHUNK_MAX {
        out.push(Arc::new(entries));
        return;
    }
    let pieces = entries.len().div_ceil(CHUNK_MAX / 2);
    let size = entries.len().div_ceil(pieces);
    out.extend(entries.chunks(size).map(|c| Arc::new(c.to_vec())));
}

enum Step {
    Old(SocketAddr),
    New(SocketAddr),
    Changed(SocketAddr),
}

/// Walks `old` and `new` in address order, calling `f` for every
/// difference until it returns false. Where both stand at the start of one
/// shared chunk, the chunk is skipped whole.
fn walk(old: &EndpointSet, new: &EndpointSet, mut f: impl FnMut(Step) -> bool) {
    if old.ptr_eq(new) {
        return;
    }
    let (oc, nc) = (&old.chunks, &new.chunks);
    let (mut oi, mut oj, mut ni, mut nj) = (0, 0, 0, 0);
    loop {
        if oj == 0 && nj == 0 && oi < oc.len() && ni < nc.len() && Arc::ptr_eq(&oc[oi], &nc[ni]) {
            oi += 1;
            ni += 1;
            continue;
        }
        let o = oc.get(oi).map(|c| &c[oj]);
        let n = nc.get(ni).map(|c| &c[nj]);
        let (step_old, step_new) = match (o, n) {
            (None, None) => return,
            (Some((a, _)), None) => (Some(Step::Old(*a)), false),
            (None, Some((a, _))) => (Some(Step::New(*a)), true),
            (Some((oa, om)), Some((na, nm))) => match oa.cmp(na) {
                std::cmp::Ordering::Less => (Some(Step::Old(*oa)), false),
                std::cmp::Ordering::Greater => (Some(Step::New(*na)), true),
                std::cmp::Ordering::Equal => {
                    let step = (om != nm).then_some(Step::Changed(*na));
                    advance(oc, &mut oi, &mut oj);
                    advance(nc, &mut ni, &mut nj);
                    if let Some(step) = step {
                        if !f(step) {
                            return;
                        }
                    }
                    continue;
                }
            },
        };
        if step_new {
            advance(nc, &mut ni, &mut nj);
        } else {
            advance(oc, &mut oi, &mut oj);
        }
        if let Some(step) = step_old {
            if !f(step) {
                return;
            }
        }
    }
}

fn advance(chunks: &[Chunk], i: &mut usize, j: &mut usize) {
    *j += 1;
    if *j == chunks[*i].len() {
        *i += 1;
        *j = 0;
    }
}

impl FromIterator<Entry> for EndpointSet {
    /// For one address, the last entry wins (as collecting a map does).
    fn from_iter<I: IntoIterator<Item = Entry>>(iter: I) -> Self {
        let map: std::collections::BTreeMap<SocketAddr, EndpointMeta> = iter.into_iter().collect();
        Self::from_sorted(map.into_iter())
    }
}

impl From<std::collections::BTreeMap<SocketAddr, EndpointMeta>> for EndpointSet {
    fn from(map: std::collections::BTreeMap<SocketAddr, EndpointMeta>) -> Self {
        Self::from_sorted(map.into_iter())
    }
}

impl std::ops::Index<&SocketAddr> for EndpointSet {
    type Output = EndpointMeta;

    fn index(&self, addr: &SocketAddr) -> &EndpointMeta {
        self.get(addr).expect("no endpoint at that address")
    }
}

impl PartialEq for EndpointSet {
    fn eq(&self, other: &Self) -> bool {
        if self.len != other.len {
            return false;
        }
        let mut same = true;
        walk(self, other, |_| {
            same = false;
            false
        });
        same
    }
}

impl Eq for EndpointSet {}

impl std::fmt::Debug for EndpointSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// What [`EndpointSet::changes_from`] must say between two plain maps:
/// the addresses gone, and those new or with other metadata, for the tests
/// that check it.
#[cfg(test)]
pub(crate) fn expected_changes(
    old: &std::collections::BTreeMap<SocketAddr, EndpointMeta>,
    new: &std::collections::BTreeMap<SocketAddr, EndpointMeta>,
) -> (Vec<SocketAddr>, Vec<SocketAddr>) {
    let removed = old
        .keys()
        .filter(|a| !new.contains_key(a))
        .copied()
        .collect();
    let added = new
        .iter()
        .filter(|(a, m)| old.get(a) != Some(m))
        .map(|(a, _)| *a)
        .collect();
    (removed, added)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn meta(weight: u32) -> EndpointMeta {
        EndpointMeta {
            weight,
            identity: None,
            zone: None,
            meshed: true,
            opaque: false,
            name: None,
            cluster: None,
            authority_override: None,
            tier: None,
        }
    }

    fn addr(n: u64) -> SocketAddr {
        SocketAddr::from(([10, 0, (n >> 8) as u8, n as u8], 80))
    }

    fn check_shape(set: &EndpointSet) {
        assert!(set
            .chunks
            .iter()
            .all(|c| !c.is_empty() && c.len() <= CHUNK_MAX));
        assert_eq!(set.len, set.chunks.iter().map(|c| c.len()).sum::<usize>());
        assert!(set.keys().zip(set.keys().skip(1)).all(|(a, b)| a < b));
    }

    /// Random batches of inserts, replacements and removals (dense and
    /// sparse, small and large sets) give what the same batches give a
    /// map; comparisons and diffs agree with the map's; the chunks a
    /// batch does not touch stay shared.
    #[test]
    fn changes_apply_as_to_a_map_and_share_what_they_do_not_touch() {
        let mut next = crate::test_rng(0x9e37_79b9_7f4a_7c15);
        for round in 0..60 {
            let space = [40, 600, 3_000][round % 3];
            let mut model: BTreeMap<SocketAddr, EndpointMeta> = (0..next(space))
                .map(|_| (addr(next(space)), meta(1 + next(3) as u32)))
                .collect();
            let mut set = EndpointSet::from(model.clone());
            check_shape(&set);
            for _ in 0..20 {
                let before = (set.clone(), model.clone());
                let batch = if next(4) == 0 { next(space) } else { next(4) };
                let changes: Vec<SetChange> = (0..batch)
                    .map(|_| match next(3) {
                        0 => SetChange::Remove(addr(next(space))),
                        _ => SetChange::Insert(addr(next(space)), meta(1 + next(3) as u32)),
                    })
                    .collect();
                // The map's way: removals, then inserts.
                for c in &changes {
                    if let SetChange::Remove(a) = c {
                        model.remove(a);
                    }
                }
                for c in &changes {
                    if let SetChange::Insert(a, m) = c {
                        model.insert(*a, m.clone());
                    }
                }
                let touched: Vec<SocketAddr> = changes.iter().map(SetChange::addr).collect();
                set = set.with_changes(changes);
                check_shape(&set);
                assert!(set.iter().map(|(a, m)| (*a, m.clone())).eq(model.clone()));
                assert!(set == EndpointSet::from(model.clone()));
                for a in &touched {
                    assert_eq!(set.get(a), model.get(a));
                }

                let (old_set, old_model) = before;
                let (removed, added) = set.changes_from(&old_set);
                let (want_removed, want_added) = expected_changes(&old_model, &model);
                assert_eq!(removed, want_removed);
                assert_eq!(added, want_added);
                assert_eq!(set == old_set, old_model == model);

                // Chunks with no touched address are the same chunks, but
                // for the chunk an address between two goes to, and a
                // neighbour a shrunken touched chunk joins.
                let untouched: Vec<&Chunk> = old_set
                    .chunks
                    .iter()
                    .filter(|c| {
                        let (lo, hi) = (c[0].0, c[c.len() - 1].0);
                        !touched.iter().any(|a| (lo..=hi).contains(a))
                    })
                    .collect();
                let shared = untouched
                    .iter()
                    .filter(|c| set.chunks.iter().any(|n| Arc::ptr_eq(c, n)))
                    .count();
                assert!(shared + 2 * touched.len() >= untouched.len());
            }
        }
    }

    /// One endpoint replaced in 100,000: the new version copies a chunk or
    /// two, and its diff against the old one visits a few chunks, not
    /// every endpoint.
    #[test]
    fn a_change_to_a_large_set_copies_and_compares_little() {
        let big: EndpointSet = (0..100_000u64).map(|n| (addr_wide(n), meta(1))).collect();
        let next = big.with_changes(vec![
            SetChange::Remove(addr_wide(500)),
            SetChange::Insert(addr_wide(100_000), meta(1)),
        ]);
        let fresh = next
            .chunks
            .iter()
            .filter(|c| !big.chunks.iter().any(|o| Arc::ptr_eq(c, o)))
            .count();
        assert!(fresh <= 2, "{fresh} chunks copied");
        let mut visited = 0;
        walk(&big, &next, |_| {
            visited += 1;
            true
        });
        assert_eq!(visited, 2);
        assert_eq!(
            next.changes_from(&big),
            (vec![addr_wide(500)], vec![addr_wide(100_000)])
        );
    }

    fn addr_wide(n: u64) -> SocketAddr {
        SocketAddr::from(([10, (n >> 16) as u8, (n >> 8) as u8, n as u8], 80))
    }

    /// Two distinct lists that share parts differ by what their other
    /// parts hold, endpoint by endpoint; lists that may repeat an address
    /// are never compared that way.
    #[test]
    fn list_changes_are_the_endpoints_of_the_parts_that_differ() {
        let ep = |n: u64, weight: u32| EndpointSpec {
            weight,
            ..EndpointSpec::new(addr(n))
        };
        let a: Arc<[EndpointSpec]> = (0..100).map(|n| ep(n, 1)).collect::<Vec<_>>().into();
        let b: Arc<[EndpointSpec]> = (100..200).map(|n| ep(n, 1)).collect::<Vec<_>>().into();
        let b2: Arc<[EndpointSpec]> = (101..201)
            .map(|n| ep(n, if n == 150 { 7 } else { 1 }))
            .collect::<Vec<_>>()
            .into();
        let old = EndpointList::distinct_parts(vec![a.clone(), b]);
        let new = EndpointList::distinct_parts(vec![a.clone(), b2.clone()]);
        let changes = new.changes_from(&old).unwrap();
        let addrs = |eps: &[EndpointSpec]| {
            let mut v: Vec<SocketAddr> = eps.iter().map(|e| e.address).collect();
            v.sort();
            v
        };
        assert_eq!(addrs(&changes.removed), vec![addr(100), addr(150)]);
        assert_eq!(addrs(&changes.added), vec![addr(150), addr(200)]);
        assert!(changes.names.is_empty());
        assert_eq!(new.len(), 200);
        assert_eq!(new[100].address, addr(101));
        // Shared parts out of order, or a list that may repeat addresses:
        // no part-by-part changes.
        let swapped = EndpointList::distinct_parts(vec![b2.clone(), a.clone()]);
        let both = EndpointList::distinct_parts(vec![a.clone(), b2]);
        assert!(swapped.changes_from(&both).is_none());
        let plain = EndpointList::from(a.to_vec());
        assert!(plain.changes_from(&plain.clone()).is_none());
        assert_eq!(plain, EndpointList::distinct_parts(vec![a]));
    }
}
