// Package idl is the request and response of the best-practice examples,
// serialised straight into shared memory.
package idl

import (
	"encoding/binary"

	"github.com/goshm/shmipc/compat/shmipc"
)

// Request is a client's request.
type Request struct {
	ID   uint64
	Name string
	Key  []byte
}

// Response is a server's answer to a Request.
type Response struct {
	ID    uint64
	Name  string
	Image []byte
}

// WriteToShm serialises r with writer.
func (r *Request) WriteToShm(writer shmipc.BufferWriter) error {
	return writeMsg(writer, r.ID, r.Name, r.Key)
}

// ReadFromShm deserialises r from reader.
func (r *Request) ReadFromShm(reader shmipc.BufferReader) (err error) {
	r.ID, r.Name, r.Key, err = readMsg(reader)
	return err
}

// Reset clears r.
func (r *Request) Reset() { *r = Request{} }

// WriteToShm serialises r with writer.
func (r *Response) WriteToShm(writer shmipc.BufferWriter) error {
	return writeMsg(writer, r.ID, r.Name, r.Image)
}

// ReadFromShm deserialises r from reader.
func (r *Response) ReadFromShm(reader shmipc.BufferReader) (err error) {
	r.ID, r.Name, r.Image, err = readMsg(reader)
	return err
}

// Reset clears r.
func (r *Response) Reset() { *r = Response{} }

func writeMsg(writer shmipc.BufferWriter, id uint64, name string, data []byte) error {
	head, err := writer.Reserve(16)
	if err != nil {
		return err
	}
	binary.BigEndian.PutUint64(head, id)
	binary.BigEndian.PutUint32(head[8:], uint32(len(name)))
	binary.BigEndian.PutUint32(head[12:], uint32(len(data)))
	if err := writer.WriteString(name); err != nil {
		return err
	}
	_, err = writer.WriteBytes(data)
	return err
}

func readMsg(reader shmipc.BufferReader) (id uint64, name string, data []byte, err error) {
	head, err := reader.ReadBytes(16)
	if err != nil {
		return 0, "", nil, err
	}
	id = binary.BigEndian.Uint64(head)
	nameLen, dataLen := binary.BigEndian.Uint32(head[8:]), binary.BigEndian.Uint32(head[12:])
	if name, err = reader.ReadString(int(nameLen)); err != nil {
		return 0, "", nil, err
	}
	if data, err = reader.ReadBytes(int(dataLen)); err != nil {
		return 0, "", nil, err
	}
	return id, name, data, nil
}
