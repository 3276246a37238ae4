//! One service's endpoints merged across the registry files that list
//! them, kept between changes: a change to one file re-merges that file's
//! listings — and those of another file only where one of them lists an
//! address the other lists too — never the service's other files.
//!
//! The rule is the file registry's: files in path order, each file's
//! listings in document order, and an address listed again for a port an
//! earlier listing of it serves is ignored. Every listing of an address is
//! kept in that order, so which listing stands is decided per address. A
//! listing is known by its file and its rank among that file's listings of
//! the same address, which an edit elsewhere in the file leaves alone: a
//! changed file is compared with its previous version (both sorted by
//! address), and only the listings that differ touch the service's map.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tether_core::registry::EndpointSpec;

#[derive(Default)]
pub(super) struct EndpointMerge {
    /// The files merged, in path order.
    parts: BTreeMap<PathBuf, Part>,
    /// Each part's path by its id (listings name files by id).
    paths: HashMap<u32, PathBuf>,
    next_id: u32,
    /// Every listing of each address, in merge order: the first inline,
    /// so a service whose addresses are listed once allocates nothing per
    /// address.
    listings: HashMap<SocketAddr, Listings>,
    /// How many times a file's listings were read, for tests of what a
    /// change costs.
    #[cfg(test)]
    pub(super) files_read: usize,
}

/// A listing's address, its rank among its file's listings of that
/// address, and the port it serves (`None`: every port).
type Key = (SocketAddr, u32, Option<u16>);

/// One file's share of the service.
struct Part {
    id: u32,
    /// The version of the file's documents it was merged from.
    generation: u64,
    /// The file's listings, sorted by address and rank.
    listed: Vec<Key>,
    /// The listings that stand, in the file's order, shared with the
    /// service states served.
    kept: Arc<[EndpointSpec]>,
    /// How many listings an earlier one overrides.
    dropped: usize,
}

#[derive(Clone, Copy, Debug)]
struct Listing {
    file: u32,
    rank: u32,
    port: Option<u16>,
    kept: bool,
}

struct Listings {
    first: Listing,
    more: Vec<Listing>,
}

impl Listings {
    fn iter(&self) -> impl Iterator<Item = &Listing> {
        std::iter::once(&self.first).chain(&self.more)
    }

    fn find(&self, file: u32, rank: u32) -> Option<&Listing> {
        self.iter().find(|l| l.file == file && l.rank == rank)
    }

    /// Removes one listing; returns it, and whether none is left.
    fn remove(&mut self, file: u32, rank: u32) -> (Option<Listing>, bool) {
        if self.first.file == file && self.first.rank == rank {
            let removed = self.first;
            if self.more.is_empty() {
                return (Some(removed), true);
            }
            self.first = self.more.remove(0);
            return (Some(removed), false);
        }
        let at = self
            .more
            .iter()
            .position(|l| l.file == file && l.rank == rank);
        (at.map(|at| self.more.remove(at)), false)
    }

    /// Decides again which listings stand, in order: each unless a kept
    /// earlier one serves a port it serves. Records each listing whose
    /// standing changed: its file, and whether it now stands.
    fn settle(&mut self, changed: &mut Vec<(u32, bool)>) {
        let mut kept: Vec<Option<u16>> = Vec::new();
        for l in std::iter::once(&mut self.first).chain(&mut self.more) {
            let stands = !kept.iter().any(|&p| serves_overlap(p, l.port));
            if stands {
                kept.push(l.port);
            }
            if l.kept != stands {
                l.kept = stands;
                changed.push((l.file, stands));
            }
        }
    }
}

fn serves_overlap(a: Option<u16>, b: Option<u16>) -> bool {
    a.is_none() || b.is_none() || a == b
}

/// A file's listings as keys, sorted by address and rank.
fn keys_of(listings: &[&EndpointSpec]) -> Vec<Key> {
    let mut by_address: Vec<(SocketAddr, u32, Option<u16>)> = listings
        .iter()
        .enumerate()
        .map(|(seq, ep)| (ep.address, seq as u32, ep.port))
        .collect();
    by_address.sort_unstable_by_key(|&(address, seq, _)| (address, seq));
    let mut rank = 0;
    for i in 0..by_address.len() {
        rank = if i > 0 && by_address[i - 1].0 == by_address[i].0 {
            rank + 1
        } else {
            0
        };
        by_address[i].1 = rank;
    }
    by_address
}

/// Each listing's rank among the listings of its address, in order.
fn ranks<'a>(listings: &'a [&'a EndpointSpec]) -> impl Iterator<Item = (&'a EndpointSpec, u32)> {
    let mut seen: HashMap<SocketAddr, u32> = HashMap::new();
    listings.iter().map(move |ep| {
        let n = seen.entry(ep.address).or_insert(0);
        *n += 1;
        (*ep, *n - 1)
    })
}

impl EndpointMerge {
    /// Brings the merge up to `files` (path order, each with the version
    /// of its documents), reading the listings of a file whose version
    /// changed with `listings_of`. Returns the parts to serve, in order.
    pub(super) fn sync<'a>(
        &mut self,
        files: &[(&Path, u64)],
        listings_of: impl Fn(&Path) -> Vec<&'a EndpointSpec>,
    ) -> Vec<Arc<[EndpointSpec]>> {
        let mut affected: Vec<SocketAddr> = Vec::new();
        // The listings just read, by file, for building its part.
        let mut fresh: HashMap<u32, Vec<&'a EndpointSpec>> = HashMap::new();
        let wanted: BTreeSet<&Path> = files.iter().map(|(p, _)| *p).collect();
        let gone: Vec<PathBuf> = self
            .parts
            .keys()
            .filter(|p| !wanted.contains(p.as_path()))
            .cloned()
            .collect();
        for path in gone {
            if let Some(part) = self.parts.remove(&path) {
                for &(address, rank, _) in &part.listed {
                    self.unlist(part.id, address, rank);
                    affected.push(address);
                }
                self.paths.remove(&part.id);
            }
        }
        for &(path, generation) in files {
            if self.parts.get(path).map(|p| p.generation) == Some(generation) {
                continue;
            }
            let listings = listings_of(path);
            #[cfg(test)]
            {
                self.files_read += 1;
            }
            let id = match self.parts.get(path) {
                Some(part) => part.id,
                None => {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.paths.insert(id, path.to_path_buf());
                    self.parts.insert(
                        path.to_path_buf(),
                        Part {
                            id,
                            generation,
                            listed: Vec::new(),
                            kept: Arc::new([]),
                            dropped: 0,
                        },
                    );
                    id
                }
            };
            let part = self.parts.get_mut(path).expect("inserted above");
            let new = keys_of(&listings);
            let old = std::mem::replace(&mut part.listed, new);
            part.generation = generation;
            // Only the listings that differ from the file's last version.
            let new = std::mem::take(&mut part.listed);
            let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
            loop {
                let (gone, came) = match (o.peek(), n.peek()) {
                    (None, None) => break,
                    (Some(&&a), None) => (Some(a), None),
                    (None, Some(&&b)) => (None, Some(b)),
                    (Some(&&a), Some(&&b)) => match (a.0, a.1).cmp(&(b.0, b.1)) {
                        std::cmp::Ordering::Less => (Some(a), None),
                        std::cmp::Ordering::Greater => (None, Some(b)),
                        std::cmp::Ordering::Equal if a.2 == b.2 => (None, None),
                        std::cmp::Ordering::Equal => (Some(a), Some(b)),
                    },
                };
                match (gone, came) {
                    (None, None) => {
                        o.next();
                        n.next();
                    }
                    _ => {
                        if let Some((address, rank, _)) = gone {
                            self.unlist(id, address, rank);
                            affected.push(address);
                            o.next();
                        }
                        if let Some((address, rank, port)) = came {
                            self.list(id, rank, address, port);
                            affected.push(address);
                            n.next();
                        }
                    }
                }
            }
            self.parts.get_mut(path).expect("inserted above").listed = new;
            fresh.insert(id, listings);
        }
        affected.sort_unstable();
        affected.dedup();
        let mut changed = Vec::new();
        for address in affected {
            if let Some(listings) = self.listings.get_mut(&address) {
                listings.settle(&mut changed);
            }
        }
        let mut rebuild: BTreeSet<u32> = fresh.keys().copied().collect();
        for (file, stands) in changed {
            if let Some(part) = self.paths.get(&file).and_then(|p| self.parts.get_mut(p)) {
                if stands {
                    part.dropped -= 1;
                } else {
                    part.dropped += 1;
                }
            }
            rebuild.insert(file);
        }
        for id in rebuild {
            let Some(path) = self.paths.get(&id).cloned() else {
                continue;
            };
            let listings = fresh.remove(&id).unwrap_or_else(|| {
                #[cfg(test)]
                {
                    self.files_read += 1;
                }
                listings_of(&path)
            });
            let part = self.parts.get_mut(&path).expect("a part per id");
            part.kept = if part.dropped == 0 {
                listings.into_iter().cloned().collect()
            } else {
                let listings_map = &self.listings;
                ranks(&listings)
                    .filter(|&(ep, rank)| {
                        listings_map
                            .get(&ep.address)
                            .and_then(|l| l.find(id, rank))
                            .is_some_and(|l| l.kept)
                    })
                    .map(|(ep, _)| ep.clone())
                    .collect()
            };
        }
        self.parts
            .values()
            .filter(|p| !p.kept.is_empty())
            .map(|p| p.kept.clone())
            .collect()
    }

    /// Removes a listing; one that did not stand counts no more against
    /// its file.
    fn unlist(&mut self, file: u32, address: SocketAddr, rank: u32) {
        let Some(listings) = self.listings.get_mut(&address) else {
            return;
        };
        let (removed, empty) = listings.remove(file, rank);
        if empty {
            self.listings.remove(&address);
        }
        if removed.is_some_and(|l| !l.kept) {
            if let Some(part) = self.paths.get(&file).and_then(|p| self.parts.get_mut(p)) {
                part.dropped -= 1;
            }
        }
    }

    /// Adds a listing (standing, until settled) at its place in merge
    /// order: path, then rank.
    fn list(&mut self, file: u32, rank: u32, address: SocketAddr, port: Option<u16>) {
        let listing = Listing {
            file,
            rank,
            port,
            kept: true,
        };
        let listings = match self.listings.entry(address) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(Listings {
                    first: listing,
                    more: Vec::new(),
                });
                return;
            }
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        };
        let paths = &self.paths;
        let order = |l: &Listing| (&paths[&l.file], l.rank);
        let key = order(&listing);
        if key < order(&listings.first) {
            let first = std::mem::replace(&mut listings.first, listing);
            listings.more.insert(0, first);
            return;
        }
        let at = listings.more.partition_point(|l| order(l) < key);
        listings.more.insert(at, listing);
    }

    /// What the merge keeps: parts, file ids, addresses, and listings of
    /// an address beyond its first.
    #[cfg(test)]
    pub(super) fn bookkeeping(&self) -> (usize, usize, usize, usize) {
        let more = self.listings.values().map(|l| l.more.len()).sum();
        (
            self.parts.len(),
            self.paths.len(),
            self.listings.len(),
            more,
        )
    }

    /// How many listings an earlier one overrides, in every file.
    pub(super) fn duplicates(&self) -> usize {
        self.parts.values().map(|p| p.dropped).sum()
    }

    /// The first overridden listing in merge order: its address, the file
    /// of the listing kept, and its own file.
    pub(super) fn first_duplicate<'a>(
        &self,
        listings_of: impl Fn(&Path) -> Vec<&'a EndpointSpec>,
    ) -> Option<(SocketAddr, PathBuf, PathBuf)> {
        let (path, part) = self.parts.iter().find(|(_, p)| p.dropped > 0)?;
        let listings = listings_of(path);
        let first = ranks(&listings).find_map(|(ep, rank)| {
            let listings = self.listings.get(&ep.address)?;
            if listings.find(part.id, rank)?.kept {
                return None;
            }
            let kept = listings
                .iter()
                .find(|l| l.kept && serves_overlap(l.port, ep.port))?;
            Some((ep.address, self.paths[&kept.file].clone(), path.clone()))
        });
        first
    }
}
