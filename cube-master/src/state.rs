//! The sandbox state machine. Every transition is checked here; the database update is
//! conditional on the previous state, so a racing writer cannot skip a step.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SandboxState {
    Creating,
    Running,
    Pausing,
    Paused,
    Resuming,
    Killing,
    Killed,
    Failed,
    /// Its node stopped answering (missed heartbeats or polls). Not terminal: the node may
    /// come back with it (→ running/paused) or without it (→ failed); kill and expiry still work.
    Lost,
}

impl SandboxState {
    pub const ALL: [SandboxState; 9] = [
        SandboxState::Creating,
        SandboxState::Running,
        SandboxState::Pausing,
        SandboxState::Paused,
        SandboxState::Resuming,
        SandboxState::Killing,
        SandboxState::Killed,
        SandboxState::Failed,
        SandboxState::Lost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
            SandboxState::Killing => "killing",
            SandboxState::Killed => "killed",
            SandboxState::Failed => "failed",
            SandboxState::Lost => "lost",
        }
    }

    /// Terminal states: the sandbox holds nothing on any node.
    pub fn is_terminal(self) -> bool {
        matches!(self, SandboxState::Killed | SandboxState::Failed)
    }

    /// Whether `self → to` is a legal step.
    pub fn can_go(self, to: SandboxState) -> bool {
        use SandboxState::*;
        matches!(
            (self, to),
            (Creating, Running | Failed | Killing)
                | (Running, Pausing | Killing | Failed)
                | (Pausing, Paused | Running | Killing | Failed)
                | (Paused, Resuming | Killing)
                | (Resuming, Running | Paused | Killing | Failed)
                | (Killing, Killed | Failed)
                | (Running | Paused | Pausing | Resuming, Lost)
                | (Lost, Running | Paused | Killing | Failed)
        )
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SandboxState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SandboxState::ALL
            .into_iter()
            .find(|x| x.as_str() == s)
            .ok_or_else(|| format!("unknown sandbox state {s:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::SandboxState::*;
    use super::*;

    #[test]
    fn legal_paths() {
        for (a, b) in [
            (Creating, Running),
            (Running, Pausing),
            (Pausing, Paused),
            (Paused, Resuming),
            (Resuming, Running),
            (Running, Killing),
            (Killing, Killed),
            (Creating, Failed),
            (Running, Lost),
            (Paused, Lost),
            (Lost, Running),
            (Lost, Paused),
            (Lost, Killing),
            (Lost, Failed),
        ] {
            assert!(a.can_go(b), "{a} -> {b}");
        }
    }

    #[test]
    fn illegal_paths() {
        for (a, b) in [
            (Killed, Running),
            (Failed, Running),
            (Paused, Running),
            (Running, Paused),
            (Killed, Killing),
            (Creating, Paused),
            (Creating, Lost),
            (Killing, Lost),
            (Killed, Lost),
            (Lost, Resuming),
        ] {
            assert!(!a.can_go(b), "{a} -> {b}");
        }
    }

    #[test]
    fn names_round_trip() {
        for s in SandboxState::ALL {
            assert_eq!(s.as_str().parse::<SandboxState>().unwrap(), s);
        }
        assert!("bogus".parse::<SandboxState>().is_err());
    }
}
