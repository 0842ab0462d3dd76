//! Guest agent wire protocol (grows with the agent issue).
