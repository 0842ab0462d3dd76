//! Frames on a byte stream: reading one whole frame (its length checked against a limit
//! before anything is allocated) and writing one.

use std::io::{self, Read, Write};

use crate::Error;

/// Reads one frame (length prefix included) from a byte stream.
///
/// `Ok(None)`: clean end of stream before the first byte of a frame.
/// `Err(Error::FrameTooLarge)`: the length field exceeds `max`; nothing more was read, and
/// the stream can no longer be trusted to be at a frame boundary.
pub fn read_frame(r: &mut impl Read, max: u32) -> Result<Option<Vec<u8>>, Error> {
    let mut prefix = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut prefix[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(Error::Closed),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::Io(e)),
        }
    }
    let len = u32::from_le_bytes(prefix);
    if len > max {
        return Err(Error::FrameTooLarge {
            len: u64::from(len),
            max,
        });
    }
    let mut frame = vec![0u8; 4 + len as usize];
    frame[..4].copy_from_slice(&prefix);
    r.read_exact(&mut frame[4..]).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            Error::Closed
        } else {
            Error::Io(e)
        }
    })?;
    Ok(Some(frame))
}

/// Writes one encoded frame.
pub fn write_frame(w: &mut impl Write, frame: &[u8]) -> Result<(), Error> {
    w.write_all(frame).map_err(Error::Io)
}
