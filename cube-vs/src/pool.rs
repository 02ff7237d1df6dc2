//! Allocator of per-sandbox host addresses from the node-local pool.
//!
//! The pool itself holds no persistent state: cubelet persists which sandbox owns which address
//! in its own per-sandbox records (or reads them back from the switch with
//! [`crate::Switch::adopt_existing`]) and calls [`AddrPool::mark_in_use`] for each after a
//! restart, before allocating anything new.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use crate::config::Ipv4Cidr;
use crate::error::{Error, Result};

/// A pool of unique host addresses. The network and broadcast addresses of the pool are never
/// handed out. Allocation goes round-robin so that a just-released address (which may still have
/// conntrack entries or neighbour state) is reused as late as possible.
#[derive(Debug, Clone)]
pub struct AddrPool {
    cidr: Ipv4Cidr,
    first: u32,
    last: u32,
    next: u32,
    in_use: BTreeSet<u32>,
}

impl AddrPool {
    /// A pool over `cidr`; fails for networks with no usable host address (/31, /32).
    pub fn new(cidr: Ipv4Cidr) -> Result<Self> {
        if cidr.prefix_len() > 30 {
            return Err(Error::PoolTooSmall(cidr.to_string()));
        }
        let base = u32::from(cidr.addr());
        let first = base + 1;
        let last = base + (cidr.size() as u32 - 2);
        Ok(AddrPool {
            cidr,
            first,
            last,
            next: first,
            in_use: BTreeSet::new(),
        })
    }

    /// The pool's network.
    pub fn cidr(&self) -> Ipv4Cidr {
        self.cidr
    }

    /// Number of addresses the pool can hand out in total.
    pub fn capacity(&self) -> usize {
        (self.last - self.first + 1) as usize
    }

    /// Number of addresses in use.
    pub fn used(&self) -> usize {
        self.in_use.len()
    }

    /// Takes a free address.
    pub fn allocate(&mut self) -> Result<Ipv4Addr> {
        if self.in_use.len() >= self.capacity() {
            return Err(Error::PoolExhausted(self.cidr.to_string()));
        }
        let mut candidate = self.next;
        loop {
            if !self.in_use.contains(&candidate) {
                self.in_use.insert(candidate);
                self.next = if candidate == self.last {
                    self.first
                } else {
                    candidate + 1
                };
                return Ok(candidate.into());
            }
            candidate = if candidate == self.last {
                self.first
            } else {
                candidate + 1
            };
        }
    }

    /// Returns an address to the pool. Returns false when it was not in use.
    pub fn release(&mut self, addr: Ipv4Addr) -> bool {
        self.in_use.remove(&u32::from(addr))
    }

    /// Records an address found in use (re-adoption after a restart). Returns false when it was
    /// already marked; fails when it is not a usable address of this pool.
    pub fn mark_in_use(&mut self, addr: Ipv4Addr) -> Result<bool> {
        let a = u32::from(addr);
        if a < self.first || a > self.last {
            return Err(Error::OutsidePool {
                addr,
                pool: self.cidr.to_string(),
            });
        }
        Ok(self.in_use.insert(a))
    }

    /// Whether the address is currently allocated.
    pub fn is_in_use(&self, addr: Ipv4Addr) -> bool {
        self.in_use.contains(&u32::from(addr))
    }

    /// Whether the address is a usable address of this pool.
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        let a = u32::from(addr);
        a >= self.first && a <= self.last
    }

    /// All addresses in use, sorted (for persistence).
    pub fn in_use(&self) -> Vec<Ipv4Addr> {
        self.in_use.iter().map(|&a| a.into()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(s: &str) -> AddrPool {
        AddrPool::new(s.parse().unwrap()).unwrap()
    }

    #[test]
    fn allocates_unique_usable_addresses_until_exhausted() {
        let mut p = pool("10.9.0.0/29");
        assert_eq!(p.capacity(), 6);
        let got: Vec<_> = (0..6).map(|_| p.allocate().unwrap()).collect();
        let expect: Vec<Ipv4Addr> = (1..=6).map(|i| Ipv4Addr::new(10, 9, 0, i)).collect();
        assert_eq!(got, expect);
        assert!(matches!(p.allocate(), Err(Error::PoolExhausted(_))));
        assert!(p.release(Ipv4Addr::new(10, 9, 0, 3)));
        assert!(!p.release(Ipv4Addr::new(10, 9, 0, 3)));
        assert_eq!(p.allocate().unwrap(), Ipv4Addr::new(10, 9, 0, 3));
    }

    #[test]
    fn round_robin_delays_reuse_of_released_addresses() {
        let mut p = pool("10.9.0.0/24");
        let a = p.allocate().unwrap();
        p.release(a);
        let b = p.allocate().unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn mark_in_use_is_respected_and_validated() {
        let mut p = pool("10.9.0.0/29");
        assert!(p.mark_in_use(Ipv4Addr::new(10, 9, 0, 1)).unwrap());
        assert!(!p.mark_in_use(Ipv4Addr::new(10, 9, 0, 1)).unwrap());
        assert_eq!(p.allocate().unwrap(), Ipv4Addr::new(10, 9, 0, 2));
        assert!(p.mark_in_use(Ipv4Addr::new(10, 9, 0, 0)).is_err()); // network address
        assert!(p.mark_in_use(Ipv4Addr::new(10, 9, 0, 7)).is_err()); // broadcast
        assert!(p.mark_in_use(Ipv4Addr::new(10, 8, 0, 1)).is_err());
        assert_eq!(
            p.in_use(),
            vec![Ipv4Addr::new(10, 9, 0, 1), Ipv4Addr::new(10, 9, 0, 2)]
        );
    }

    #[test]
    fn tiny_pools_are_rejected() {
        assert!(AddrPool::new("10.0.0.0/31".parse().unwrap()).is_err());
        assert!(AddrPool::new("10.0.0.0/30".parse().unwrap()).is_ok());
    }
}
