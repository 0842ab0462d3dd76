//! The per-device save/restore trait.

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Save and restore of one component (a device, the interrupt controller, ...), in the
/// style of Firecracker's `Persist`.
///
/// `State` is a plain serde struct: it ends up inside the snapshot state file's payload,
/// which is untrusted input on restore, so `restore` must validate it (ranges, lengths,
/// queue addresses inside guest memory) and return an error instead of panicking.
///
/// `ConstructorArgs` carries what the state cannot: handles owned by the VMM (guest
/// memory, an interrupt line, an eventfd, ...). The lifetime lets it borrow them.
///
/// ```
/// use snapshot::Persist;
///
/// struct Counter { value: u64, irq: u32 }
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct CounterState { value: u64 }
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("counter value {0} out of range")]
/// struct CounterError(u64);
///
/// impl<'a> Persist<'a> for Counter {
///     type State = CounterState;
///     type ConstructorArgs = u32; // the interrupt line, owned by the VMM
///     type Error = CounterError;
///
///     fn save(&self) -> Result<CounterState, CounterError> {
///         Ok(CounterState { value: self.value })
///     }
///     fn restore(irq: u32, state: &CounterState) -> Result<Self, CounterError> {
///         if state.value > 1 << 40 {
///             return Err(CounterError(state.value));
///         }
///         Ok(Counter { value: state.value, irq })
///     }
/// }
///
/// let c = Counter { value: 7, irq: 5 };
/// let restored = Counter::restore(5, &c.save().unwrap()).unwrap();
/// assert_eq!(restored.value, 7);
/// ```
pub trait Persist<'a>: Sized {
    /// The serialisable state.
    type State: Serialize + DeserializeOwned;
    /// What `restore` needs besides the state.
    type ConstructorArgs;
    /// Error of `save` and `restore`.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Capture the current state. Called with the VM paused.
    fn save(&self) -> Result<Self::State, Self::Error>;

    /// Build the component from `state` (untrusted: validate it).
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
